"""The guarantees that held before the sandbox, held through it (issue 25, point 1): with
SANDBOX=required, a SIGKILLed sidecar still takes its tool's whole tree down (the
guardian kills bwrap, whose namespace dies with it), a stage deadline kills a tree that
ignores SIGTERM and escapes its session, the per-job cgroups still limit and account a
memory hog and a fork bomb (bwrap's own two processes counted), and RUN_AS still runs the
tool as that user. Processes are found by the job id in their environment
(``kit.job_processes``): pids a sandboxed tool reports are its namespace's, not ours."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import orjson
import psutil
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_processes,
    job_row,
    journal_details,
    owner_processes,
    sandbox_extra_paths,
    short_root,
    wait_until,
)
from sidecar.worker.cgroups import detect

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.path.exists("/usr/bin/bwrap"), reason="needs bubblewrap (docs/development.md)"),
]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="per-job cgroups and RUN_AS need root")

HANG_TREE = [sys.executable, str(TOOLS / "hang_tree.py")]
MIB = 1024 * 1024


@pytest.fixture
def public_root():
    """A directory every user can reach, outside /tmp (a sandboxed tool's /tmp is its
    own); removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="sidecar-sbx-", dir="/var/tmp"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _env(dsn: str, work: Path, **extra: str) -> dict[str, str]:
    env = base_env(dsn, SIDECAR_SANDBOX="required", SIDECAR_WORK_DIR=str(short_root(work)),
                   SIDECAR_MAX_ATTEMPTS="1", **extra)
    if sandbox_extra_paths():
        env["SIDECAR_EXTRA_PATHS"] = sandbox_extra_paths()
    return env


def _row(dsn: str, job: str) -> dict:
    row = job_row(dsn, job)
    for key in ("result", "error"):
        if isinstance(row[key], str | bytes):
            row[key] = orjson.loads(row[key])
    return row


def _tree_started(job: str, at_least: int) -> list[int]:
    return wait_until(lambda: (pids := job_processes(job)) and len(pids) >= at_least and pids,
                      30, what=f"the sandboxed tree of job {job}")


def test_a_sigkilled_sidecar_takes_the_sandboxed_tree_down(dsn, sidecars, public_root):
    """kill -9 of the sidecar: the tool, its double-forked and its setsid descendants
    (all ignoring SIGTERM) and bwrap's processes are gone within seconds."""
    env = _env(dsn, public_root / "work", SIDECAR_STAGE_TIMEOUT_SECONDS="120")
    sc = sidecars(dsn, HANG_TREE, "--tool", "doomed", env=env)
    owner = sc.wait_event("worker_started", 30)["owner_id"]
    job = enqueue(dsn, "doomed", {"pidfile": "/dev/null", "tree": True})
    # The tool and its three descendants carry the job's id; bwrap and its namespace's
    # init, started ahead of the job (issue 42), only the attempt's variables.
    before = _tree_started(job, 4)
    assert len(owner_processes(owner)) > len(before)  # bwrap, its init, prepared ones
    sc.proc.kill()
    sc.proc.wait(5)
    wait_until(lambda: job_processes(job) == [], 10,
               what=f"the guardian's kill of the sandboxed tree {before}")
    wait_until(lambda: owner_processes(owner) == [], 10,
               what="bwrap's processes and the attempts prepared ahead to end")


def test_a_stage_deadline_kills_the_whole_sandboxed_tree(dsn, sidecars, public_root):
    """SIGTERM ignored by every process of the tree: after the grace the namespace is
    SIGKILLed; the journal's kill reports no survivor and nothing of the job is left."""
    env = _env(dsn, public_root / "work", SIDECAR_STAGE_TIMEOUT_SECONDS="2",
               SIDECAR_KILL_GRACE_SECONDS="0.5")
    sc = sidecars(dsn, HANG_TREE, "--tool", "stuck", env=env)
    sc.wait_event("worker_started", 30)
    job = enqueue(dsn, "stuck", {"pidfile": "/dev/null", "tree": True})
    tree = _tree_started(job, 4)  # the tool and its descendants (bwrap's two: started ahead)
    wrappers = {parent for pid in tree for parent in psutil.Process(pid).parents()
                if parent.name() == "bwrap"}
    assert len(wrappers) == 2, wrappers  # bwrap and its namespace's init
    wait_until(lambda: job_row(dsn, job)["state"] == "failed", 30, what="the stage deadline")
    assert _row(dsn, job)["error"]["kind"] == "stage_timeout"
    killed = journal_details(dsn, job, "child_killed")
    assert killed and killed[-1]["survivors"] == 0, killed
    assert job_processes(job) == []
    assert not [p for p in wrappers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@needs_root
def test_cgroup_limits_and_accounting_hold_in_the_sandbox(dsn, public_root):
    """As root with per-job cgroups: a memory hog is OOM-killed at MEMORY_BYTES with its
    peak accounted, a fork bomb stops at PROCESSES (bwrap's processes count too)."""
    host = detect()
    assert host.memory and host.pids, f"no memory/pids cgroup to test with: {host.notes}"
    env = _env(dsn, public_root / "work", SIDECAR_STAGE_TIMEOUT_SECONDS="20",
               SIDECAR_PROFILE_HOG_MEMORY_BYTES=str(64 * MIB),
               SIDECAR_PROFILE_BOMB_PROCESSES="16")
    hog = enqueue(dsn, "hog", {"mode": "memory_hog"}, env=env)
    bomb = enqueue(dsn, "bomb", {"mode": "fork_bomb"}, env=env)
    for tool in ("hog", "bomb"):
        done = cli(dsn, "run", "--tool", tool, "--drain", "--", str(TOOLS / "hostile.py"),
                   env=env, timeout=90)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        assert b'"sandbox":"bwrap"' in done.stderr.replace(b" ", b"")

    row = _row(dsn, hog)
    assert row["state"] == "failed" and row["error"]["kind"] == "memory_limit", row["error"]
    [summary] = journal_details(dsn, hog, "job_failed")
    assert summary["oom_kills"] >= 1 and 32 * MIB < summary["peak_memory_bytes"] <= 65 * MIB

    row = _row(dsn, bomb)
    assert row["state"] == "failed" and row["error"]["kind"] == "process_limit", row["error"]
    [summary] = journal_details(dsn, bomb, "job_failed")
    assert summary["process_limit_hits"] >= 1
    assert job_processes(hog) == [] and job_processes(bomb) == []


@needs_root
def test_run_as_runs_the_sandboxed_tool_as_that_user(dsn, public_root):
    """RUN_AS=65534:65534 with the sandbox: bwrap itself runs as that user (unprivileged),
    the tool sees that uid and gid and no supplementary group, and writes its HOME."""
    tool = public_root / "hostile.py"
    shutil.copy(TOOLS / "hostile.py", tool)
    tool.chmod(0o755)
    env = _env(dsn, public_root / "work", SIDECAR_PROFILE_LOOK_RUN_AS="65534:65534")
    job = enqueue(dsn, "look", {"mode": "inspect"}, env=env)
    done = cli(dsn, "run", "--tool", "look", "--drain", "--", "/usr/bin/python3", str(tool),
               env=env, timeout=90)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    seen = row["result"]
    assert (seen["uid"], seen["gid"], seen["groups"]) == (65534, 65534, []), seen


@needs_root
def test_a_sandboxed_tool_that_exits_leaves_nothing_the_sidecar_must_kill(dsn, public_root):
    """bwrap exits as soon as its namespace's init reports the tool's exit, before init
    itself has exited: with job cgroups that init was found in the cgroup and killed as
    an "orphaned descendant" after 7 of 20 successful /bin/cat jobs. Now none is."""
    host = detect()
    assert host.memory and host.pids, f"no memory/pids cgroup to test with: {host.notes}"
    env = _env(dsn, public_root / "work", SIDECAR_PROFILE_CAT_MEMORY_BYTES=str(256 * MIB))
    jobs = [enqueue(dsn, "cat", {"n": n}, env=env) for n in range(20)]
    done = cli(dsn, "run", "--tool", "cat", "--drain", "--", "/bin/cat", env=env, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b'"mode":"cgroup"' in done.stderr.replace(b" ", b"")
    assert all(_row(dsn, job)["state"] == "succeeded" for job in jobs)
    killed = [job for job in jobs if journal_details(dsn, job, "child_killed")]
    assert killed == [], [journal_details(dsn, job, "child_killed") for job in killed]


_GUARANTEE_PROBE = r'''
import asyncio, json, os, sys
from sidecar.worker import child as child_module
from sidecar.worker.bootstrap import subreaper_step
from sidecar.worker.isolation import SandboxPlan

work_root, job_dir, script = sys.argv[1], sys.argv[2], sys.argv[3]
table = subreaper_step("probe")
scans = []
real_find_tree = child_module.find_tree
child_module.find_tree = lambda *a, **k: scans.append(1) or real_find_tree(*a, **k)
plan = SandboxPlan("/usr/bin/bwrap", work_root)
cookie = {"SIDECAR_JOB_ID": "probe-" + str(os.getpid()), "SIDECAR_FENCING_TOKEN": "1"}

def marked():
    found = []
    for pid in os.listdir("/proc"):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if ("SIDECAR_JOB_ID=" + cookie["SIDECAR_JOB_ID"]).encode() in env.split(b"\0"):
            found.append(int(pid))
    return found

async def main():
    env = {"PATH": "/usr/bin:/bin", **cookie}
    tool = await child_module.Child.spawn(
        ["/bin/sh", "-c", script], env, b"", 1 << 20, lambda line: None, cookie,
        cwd=job_dir, processes=table, wrap=lambda argv, fd: plan.argv(argv, job_dir, fd))
    await tool.exited
    report = await tool.kill_tree(1.0)
    print(json.dumps({"scans": len(scans), "signal": report.signal, "survivors": report.survivors,
                      "init": tool.sandbox_init_pid, "returncode": tool.returncode,
                      "left": marked()}))

asyncio.run(main())
'''


@pytest.mark.parametrize("script", ["exit 3", "sleep 600 & sleep 600 & exit 3"])
def test_a_sandboxed_tree_is_known_dead_by_its_namespace_without_a_scan(tmp_path, script):
    """Issue 42 (each guarantee paid once): once a sandboxed tool exits, its tree is the
    PID namespace, dead when the namespace's init has exited (the kernel empties the
    namespace first). The tree kill waits for that init and scans /proc not once, and
    nothing of the tool is left, including what it left running in its namespace."""
    root = short_root(tmp_path)
    job_dir = root / "job"
    job_dir.mkdir(mode=0o700, parents=True)
    done = __import__("subprocess").run(
        [sys.executable, "-c", _GUARANTEE_PROBE, str(root), str(job_dir), script],
        capture_output=True, timeout=60, cwd=str(Path(__file__).parent.parent))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    seen = orjson.loads(done.stdout.splitlines()[-1])
    assert seen["returncode"] == 3 and seen["init"], seen
    assert seen["scans"] == 0, seen
    assert seen["signal"] is None and seen["survivors"] == [], seen
    assert seen["left"] == [], f"processes of the tool outlived its namespace: {seen}"
