"""Breaking the leftovers sweep and the orphan attribution (sidecar/worker/leftovers.py,
sidecar/worker/guardian.py, child.find_tree's claim_unmarked): can a start, a guardian or a tree
kill ever reach what belongs to a LIVE sidecar, or to nobody's job at all? Real
`sidecar run` processes, a real PostgreSQL, real tools (tests/tools/leftover_probe.py).
Tests that fail here are reproducers of bugs."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from kit import (
    FAST_PROFILE,
    TOOLS,
    base_env,
    cli,
    enqueue,
    parse_events,
    query,
    read_events,
    read_pids,
    short_root,
    wait_until,
)
from kit import job_cgroup_dirs as _job_cgroups
from kit import job_row as _row
from kit import journal_details as _journal
from kit import kill_pid as _kill
from kit import pid_alive as _alive

pytestmark = pytest.mark.e2e

PROBE = str(TOOLS / "leftover_probe.py")
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="cgroups, RUN_AS and namespaces need root")
NOBODY = "65534:65534"
KEYED = re.compile(r"^([0-9a-f]{12})\.j")






def _env(dsn, work: Path, **extra):
    return base_env(dsn, **{"SIDECAR_WORK_DIR": str(short_root(work)),
                            "SIDECAR_STAGE_TIMEOUT_SECONDS": "30",
                            "SIDECAR_DRAIN_SECONDS": "1", **extra})


def _drain(dsn, env, tool, command=(sys.executable, PROBE)):
    done = cli(dsn, "run", "--tool", tool, "--drain", "--", *command, env=env, timeout=60)
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-3000:])
    return done


def _tool_dir(pid: int, work: Path) -> Path:
    """The work directory the tool ``pid`` runs in (its current directory), one of the
    owner's keyed directories of ``work``; the others are attempts prepared ahead of their
    jobs (issue 42)."""
    found = Path(os.readlink(f"/proc/{pid}/cwd"))
    assert found in _keyed(work), (found, _keyed(work))
    return found


def _keyed(work: Path) -> list[Path]:
    """The entries of a work root named like an owner's job directory."""
    return sorted(p for p in work.iterdir() if KEYED.match(p.name))






# --- what a start sweeps ------------------------------------------------------------------

@needs_root
def test_a_start_beside_a_live_sidecar_mid_job_clears_only_dead_owners_leftovers(
        dsn, tmp_path, sidecars, public_dir):
    """S1 runs a job on work root W (job cgroups on). A hard-killed owner left a lock file,
    a work dir and job cgroups holding a live process; another left a work dir and no lock
    file. A start on another work root B (same cgroup parents) clears none of them; a start
    on W kills and removes all of the dead owners' leftovers, and nothing of S1's."""
    work, other = public_dir(), public_dir()
    pidfile = tmp_path / "victim.pid"
    # Limits on memory and processes: the job joins all three hierarchies (v1 ones are
    # joined only for a limit they enforce).
    env = _env(dsn, work, SIDECAR_PROFILE_LIVE_MEMORY_BYTES=str(2**30),
               SIDECAR_PROFILE_LIVE_PROCESSES="512")
    job = enqueue(dsn, "live", {"mode": "sleep", "seconds": 6, "pidfile": str(pidfile)},
                  "--max-attempts", "1", env=env)
    sidecars(dsn, [PROBE], "--tool", "live", env=env)
    [victim] = read_pids(pidfile, 1, 20)
    live_cgroups = _job_cgroups(victim)
    assert len(live_cgroups) == 3, live_cgroups
    live_dir = _tool_dir(victim, work)

    dead_key, lockless_key = "deadbeef0001", "cafecafe0002"
    (work / f".owner-{dead_key}.lock").write_text("")
    dead_dirs = [work / f"{dead_key}.jxabc1234", work / f"{lockless_key}.jydef5678"]
    an_hour_ago = time.time() - 3600  # younger ones are never taken for abandoned
    for d in dead_dirs:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "file").write_text("left")
        os.utime(d, (an_hour_ago, an_hour_ago))
    dead_cgroups = [c.parent / f"{dead_key}.job-x-1" for c in live_cgroups]
    stray = subprocess.Popen(["sleep", "60"])
    try:
        for c in dead_cgroups:
            c.mkdir()
            (c / "cgroup.procs").write_text(str(stray.pid))

        _drain(dsn, _env(dsn, other), "idle")  # another work root: not its locks
        assert all(c.exists() for c in dead_cgroups) and _alive(stray.pid)
        assert all(d.exists() for d in dead_dirs)

        done = _drain(dsn, env, "idle")
        [removed] = parse_events(done.stderr, "leftovers_removed")
        assert removed["count"] == 5, removed  # 3 cgroups + 2 work dirs
        assert stray.wait(5) == -signal.SIGKILL
        assert [c for c in dead_cgroups if c.exists()] == []
        assert [d for d in dead_dirs if d.exists()] == []
        assert not (work / f".owner-{dead_key}.lock").exists()
        assert _alive(victim), "the sweep killed the live sidecar's tool"
        assert live_dir.exists() and all(c.exists() for c in live_cgroups)
    finally:
        _kill(stray.pid)
        stray.wait(5)
        for c in dead_cgroups:
            with contextlib.suppress(OSError):
                c.rmdir()
    wait_until(lambda: _row(dsn, job)["state"] != "running", 20, what="the live job's end")
    row = _row(dsn, job)
    assert row["state"] == "succeeded" and row["attempt"] == 1, row["error"]


@needs_root
def test_a_run_as_tool_cannot_get_a_start_to_kill_another_live_sidecars_job(
        dsn, tmp_path, sidecars, public_dir):
    """Two sidecars, different work roots, same cgroup parents. S1 (work root A, root's,
    0755) runs a job. S2 uses the default kind of work root: a sticky world-writable
    directory like /tmp. S2's RUN_AS tool (uid 65534) reads S1's owner key from the
    world-readable cgroup parent (or A's listing) and creates ``.owner-<key>.lock`` in S2's
    work root: an empty file nobody locks. The next start on that work root takes the
    free lock for a dead owner's and kills and removes S1's LIVE job cgroups (README:
    "never a live sidecar's").

    Fix: trust a lock file only when it is a regular file (opened with O_NOFOLLOW |
    O_NONBLOCK), owned by the sweeper's euid, not group/other-writable, with one link;
    better, keep the locks in a directory only the sidecar's user can write (e.g.
    ``<work root>/.sidecar-owners``, checked to be ours and 0755 or tighter) and clear job
    cgroups only for keys whose lock lives there."""
    victim_root, shared_tmp = public_dir(0o755), public_dir(0o1777)
    pidfile = tmp_path / "victim.pid"
    env = _env(dsn, victim_root)
    job = enqueue(dsn, "victim", {"mode": "sleep", "seconds": 6, "pidfile": str(pidfile)},
                  env=env)
    sidecars(dsn, [PROBE], "--tool", "victim", env=env)
    [victim] = read_pids(pidfile, 1, 20)
    victim_dir = _tool_dir(victim, victim_root)
    key = victim_dir.name[:12]

    tmp_env = _env(dsn, shared_tmp, SIDECAR_PROFILE_FORGER_RUN_AS=NOBODY)
    forger = enqueue(dsn, "forger", {"mode": "forge", "root": str(shared_tmp),
                                     "scan": str(victim_root)}, env=tmp_env)
    _drain(dsn, tmp_env, "forger", command=("/usr/bin/python3", PROBE))
    result = _row(dsn, forger)["result"]
    # The tool could do it; it could read the key from the cgroup parent just as well.
    assert result == {"forged": [key], "in_cgroups": [key], "uid": 65534}, result

    _drain(dsn, tmp_env, "idle")  # any later start on that work root
    assert _alive(victim), "a start on another work root killed a live sidecar's job"
    wait_until(lambda: _row(dsn, job)["state"] != "running", 20, what="the victim's end")
    row = _row(dsn, job)
    assert row["state"] == "succeeded" and row["attempt"] == 1, (row["attempt"], row["error"])


@needs_root
@pytest.mark.parametrize("replace", [True, False], ids=["replaced", "deleted"])
def test_a_run_as_tool_cannot_unlock_a_live_sidecar_in_a_shared_work_root(
        dsn, tmp_path, sidecars, public_dir, replace):
    """One work root, mode 0777 without the sticky bit (what a Kubernetes emptyDir is),
    two sidecars. S2's RUN_AS tool (uid 65534) may unlink any file there. S1 still holds
    its flock, on the unlinked inode, but the sweep only looks at names:

    - replaced with an empty file of the tool's: the next start finds a free lock under
      S1's name, kills S1's live job cgroups (the tool dies) and removes its live work dir;
    - deleted: the next start removes S1's live work directory under its running tool
      (the rule for directories no lock file claims).

    Fix: keep the locks where the RUN_AS user cannot write (a ``.sidecar-owners``
    directory checked to be the sidecar's own and not group/other-writable; a lock file
    there checked the same way), and never take a missing lock for a dead owner: flock
    each attempt's work directory itself (an O_DIRECTORY fd held for the attempt) and
    remove only directories whose flock the sweep gets; refuse or warn at start when
    SIDECAR_WORK_DIR is writable by the RUN_AS user without the sticky bit."""
    work = public_dir(0o777)
    pidfile = tmp_path / "victim.pid"
    env = _env(dsn, work)
    job = enqueue(dsn, "victim", {"mode": "sleep", "seconds": 6, "pidfile": str(pidfile)},
                  env=env)
    sidecars(dsn, [PROBE], "--tool", "victim", env=env)
    [victim] = read_pids(pidfile, 1, 20)
    victim_dir = _tool_dir(victim, work)

    hostile_env = _env(dsn, work, SIDECAR_PROFILE_SWAPPER_RUN_AS=NOBODY)
    swapper = enqueue(dsn, "swapper", {"mode": "replace_locks", "root": str(work),
                                       "replace": replace}, env=hostile_env)
    _drain(dsn, hostile_env, "swapper", command=("/usr/bin/python3", PROBE))
    result = _row(dsn, swapper)["result"]
    assert result["replaced"] == [f".owner-{victim_dir.name[:12]}.lock"], result

    _drain(dsn, env, "idle")  # any later start on that work root
    assert _alive(victim), "a start killed the live sidecar's tool"
    assert victim_dir.exists(), "a start removed the live sidecar's work directory"
    wait_until(lambda: _row(dsn, job)["state"] != "running", 20, what="the victim's end")
    row = _row(dsn, job)
    assert row["state"] == "succeeded" and row["attempt"] == 1, (row["attempt"], row["error"])


# --- the guardian -------------------------------------------------------------------------

@pytest.mark.parametrize("cgroups", [pytest.param("auto", marks=needs_root), "off"])
def test_the_guardian_alone_clears_a_sigkilled_sidecars_tree_work_dir_and_cgroups(
        dsn, tmp_path, sidecars, public_dir, cgroups):
    """kill -9 of the sidecar mid-job, and no later start: the guardian kills the tool and
    its setsid grandchild (which keeps SIDECAR_OWNER_ID), and removes the attempt's job
    cgroups and work directory, in both cgroup modes."""
    work = public_dir()
    pidfile = tmp_path / "tree.pid"
    # Limits on memory and processes: the job joins all three hierarchies (v1 ones are
    # joined only for a limit they enforce; PROCESSES under rlimits would need RUN_AS).
    limits = {"SIDECAR_PROFILE_DOOMED_MEMORY_BYTES": str(2**30)}
    if cgroups == "auto":
        limits["SIDECAR_PROFILE_DOOMED_PROCESSES"] = "512"
    env = _env(dsn, work, SIDECAR_CGROUPS=cgroups, **limits)
    enqueue(dsn, "doomed", {"mode": "sleep_tree", "seconds": 60, "pidfile": str(pidfile)},
            env=env)
    first = sidecars(dsn, [PROBE], "--tool", "doomed", env=env)
    tool, grandchild = read_pids(pidfile, 2, 20)
    try:
        job_cgroups = _job_cgroups(tool)
        assert len(job_cgroups) == (3 if cgroups == "auto" else 0), job_cgroups
        _tool_dir(tool, work)
        first.proc.kill()
        first.proc.wait(5)
        wait_until(lambda: not _alive(tool) and not _alive(grandchild), 5,
                   what="the guardian's kill of the tree")
        wait_until(lambda: _keyed(work) == [] and not any(c.exists() for c in job_cgroups),
                   5, what="the guardian's removal of the work dir and job cgroups")
    finally:
        _kill(tool)
        _kill(grandchild)


# --- attributing env-less orphans (claim_unmarked) ----------------------------------------

def _interpreter_for_nobody() -> list[str]:
    """A command prefix for inside the new mount namespace that lets ``nobody`` run this
    interpreter when a directory on its real path is closed to others (a 0700 /root
    holding pyenv's Python): there, and only there, that directory is covered by a
    world-traversable tmpfs with just the needed entry bound back. Empty when nothing
    is in the way."""
    parts = Path(os.path.realpath(sys.executable)).parts
    for depth in range(1, len(parts) - 1):
        closed = Path(*parts[:depth + 1])
        if not closed.stat().st_mode & stat.S_IXOTH:
            inner = parts[depth + 1]
            script = (f'set -e; keep=$(mktemp -d); mount --bind "{closed}" "$keep"; '
                      f'mount -t tmpfs -o mode=0755 tmpfs "{closed}"; '
                      f'mkdir "{closed}/{inner}"; mount --bind "$keep/{inner}" '
                      f'"{closed}/{inner}"; umount -l "$keep"; rmdir "$keep"; exec "$@"')
            return ["sh", "-c", script, "sh"]
    return []


def _in_new_pid_namespace(argv: list[str], env: dict[str, str], log: Path,
                          as_nobody: bool = False) -> tuple[subprocess.Popen, int]:
    """Run ``argv`` as PID 1 of a new PID namespace (what a container without tini gives
    the sidecar, e.g. k8s/overlays/browser). Returns the unshare process and the
    host pid of ``argv``'s process."""
    wrap = ["unshare", "--pid", "--fork", "--mount-proc"]
    if as_nobody:
        wrap += [*_interpreter_for_nobody(),
                 "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    wrap += ["env", "-i", *[f"{k}={v}" for k, v in env.items()]]
    with open(log, "wb") as f:
        outer = subprocess.Popen([*wrap, *argv], stdout=subprocess.DEVNULL, stderr=f)

    def inner():
        try:
            kids = psutil.Process(outer.pid).children()
            return kids and "sidecar" in kids[0].cmdline() and kids[0].pid
        except psutil.Error:
            return None

    return outer, wait_until(inner, 10, what="the namespace's PID 1")


def _nsenter(pid: int, argv: list[str], as_nobody: bool = False, env=None) -> str:
    wrap = ["nsenter", "-t", str(pid), "-p", "-m", "--"]
    if as_nobody:
        wrap += ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    if env is not None:
        wrap += ["env", "-i", *[f"{k}={v}" for k, v in env.items()]]
    done = subprocess.run([*wrap, *argv], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()


def _end_namespace(outer: subprocess.Popen, init_pid: int) -> None:
    _kill(init_pid)  # PID 1 gone: the kernel kills the whole namespace
    try:
        outer.wait(10)
    except subprocess.TimeoutExpired:
        outer.kill()
        outer.wait(5)


@needs_root
def test_a_sidecar_as_pid_1_does_not_kill_its_own_embedded_postgres(tmp_path, public_dir):
    """No SIDECAR_DATABASE_URL: `sidecar run` starts the embedded PostgreSQL (pg_ctl, which
    exits) before it becomes a subreaper, so on a plain host the postmaster is never its
    child. As PID 1 of a container (no tini: k8s/overlays/browser runs the bundle
    as the container's command) every orphan is re-parented to the sidecar anyway: the
    postmaster becomes its child, without SIDECAR_JOB_ID. The first job that runs alone
    -- a well-behaved one -- ends with a tree kill whose claim_unmarked scan claims the
    postmaster and all its backends (``child_killed``, ``orphaned_descendants``, 12
    processes): the sidecar kills its own database and abandons the job.

    Fix: claim an env-less adopted process only when it is younger than the attempt
    (``create_time() >= `` the spawn) and, with RUN_AS, runs as the tool's uid; better,
    remember every child adopted while no attempt ran (and every child present at start,
    e.g. the postmaster) as never claimable; and do not claim unmarked processes at all
    as PID 1 (``os.getpid() == 1``), where strangers are adopted by design."""
    base = public_dir()
    for name in ("data", "work", "home"):
        (base / name).mkdir()
        os.chown(base / name, 65534, 65534)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(base / "home"),
           "XDG_RUNTIME_DIR": str(base / "home"), "SIDECAR_DATA_DIR": str(base / "data"),
           "SIDECAR_WORK_DIR": str(short_root(base / "work")), "SIDECAR_CGROUPS": "off",
           **{k: v for k, v in FAST_PROFILE.items() if k != "SIDECAR_HTTP_ADDR"},
           "SIDECAR_HTTP_ADDR": "off"}
    log = tmp_path / "pid1.log"
    outer, init = _in_new_pid_namespace(
        [sys.executable, "-m", "sidecar", "run", "--tool", "probe", "--", sys.executable,
         PROBE], env, log, as_nobody=True)
    try:
        wait_until(lambda: read_events(log, "worker_started"), 60,
                   what=f"the sidecar with its embedded PostgreSQL ({log})")
        postmaster = [p.pid for p in psutil.Process(init).children()
                      if str(base / "data") in " ".join(p.cmdline())]
        assert len(postmaster) == 1, "the postmaster is the sidecar's (adopted) child"
        _nsenter(init, [sys.executable, "-m", "sidecar", "enqueue", "probe", "--payload",
                        '{"mode": "ok"}'], as_nobody=True, env=env)
        ended = wait_until(lambda: [e for e in read_events(log) if e["event"] in (
            "job_succeeded", "lease_abandoned", "job_retry_scheduled", "job_failed")], 30,
                           what="the job's outcome")
        killed = read_events(log, "child_killed")
        assert _alive(postmaster[0]), f"the sidecar killed its own PostgreSQL: {killed}"
        assert [e["event"] for e in ended] == ["job_succeeded"], ended
    finally:
        _end_namespace(outer, init)


@needs_root
def test_a_sidecar_as_pid_1_kills_no_orphan_that_was_never_a_tools(dsn, tmp_path,
                                                                   public_dir):
    """The same with the test's PostgreSQL: a process somebody else left in the container
    (here a background `sleep` of a `kubectl exec`-like shell entered into the namespace)
    is re-parented to PID 1, the sidecar. It carries no SIDECAR_JOB_ID, so the tree kill of
    the next job that runs alone -- a well-behaved one -- SIGTERMs and SIGKILLs it."""
    work = public_dir()
    env = {k: v for k, v in _env(dsn, work).items() if k != "PATH"}
    env["PATH"] = "/usr/bin:/bin"
    log = tmp_path / "pid1.log"
    outer, init = _in_new_pid_namespace(
        [sys.executable, "-m", "sidecar", "run", "--tool", "probe", "--", sys.executable,
         PROBE], env, log)
    try:
        wait_until(lambda: read_events(log, "worker_started"), 20, what=f"the sidecar ({log})")
        _nsenter(init, ["sh", "-c", "sleep 61.5 >/dev/null 2>&1 &"])

        def orphan():
            for p in psutil.Process(init).children():
                with contextlib.suppress(psutil.Error):
                    if p.cmdline() == ["sleep", "61.5"]:
                        return p.pid
            return None

        stranger = wait_until(orphan, 5, what="the orphan adopted by PID 1")
        job = enqueue(dsn, "probe", {"mode": "ok"})
        wait_until(lambda: _row(dsn, job)["state"] == "succeeded", 20, what="the job")
        time.sleep(0.5)
        killed = read_events(log, "child_killed")
        assert _alive(stranger), f"a well-behaved job's tree kill took a stranger: {killed}"
        assert killed == []
    finally:
        _end_namespace(outer, init)


# --- the supervisor's lease-lost path -----------------------------------------------------

def test_a_result_file_rejected_after_a_lost_lease_is_journaled_with_its_own_digest(
        dsn, tmp_path, sidecars, public_dir):
    """README: "the tool finishes after losing the lease: result_rejected in the journal
    with the result's sha256 and size". The tool writes its result to SIDECAR_RESULT_FILE
    (stdout empty) and exits 0, but leaves a SIGTERM-ignoring child; while the tree kill
    waits out the grace the job is cancelled, so _settle takes the lease-lost path, which
    digests ``child.stdout`` and never looks at the result file: the journal says the
    rejected result was 0 bytes (sha256 of nothing).

    Fix: in _settle's lease-lost branch, digest the result file when there is one (read
    it with read_result_file, or at least fstat + hash it), else stdout."""
    work = public_dir()
    text = '{"answer": 42, "from": "the result file"}'
    pidfile = tmp_path / "linger.pid"
    env = _env(dsn, work, SIDECAR_LEASE_SECONDS="10", SIDECAR_KILL_GRACE_SECONDS="3")
    job = enqueue(dsn, "late", {"mode": "linger_result", "text": text, "seconds": 30,
                                "pidfile": str(pidfile)}, env=env)
    proc = sidecars(dsn, [PROBE], "--tool", "late", env=env)
    [lingerer] = read_pids(pidfile, 1, 20)
    try:
        done = cli(dsn, "cancel", job, env=env)
        assert done.returncode == 0, done.stderr.decode()
        proc.wait_event("result_rejected", 20)
    finally:
        _kill(lingerer)
    [rejected] = _journal(dsn, job, "result_rejected")
    expected = {"sha256": hashlib.sha256(text.encode()).hexdigest(), "bytes": len(text)}
    assert rejected.get("result") == expected, rejected


@needs_root
def test_concurrent_well_behaved_jobs_never_kill_each_others_tools(dsn, public_dir):
    """--concurrency 2, nothing but well-behaved jobs (print a result, exit 0). Each
    attempt ends with a tree kill scan; while the other slot is between fork and exec,
    only one Child is counted (ProcessTable.alone(), the new one is counted after spawn
    returns) and the sibling's forked child still shows the sidecar's own environment,
    without SIDECAR_JOB_ID: claim_unmarked claims it. The SIGTERM either kills the
    sibling's freshly exec'd tool (its job fails ``signal`` 15 and spends an attempt), or
    lands before exec, where the child still runs the sidecar's Python signal handler and
    writes SIGTERM into the inherited wakeup fd: the sidecar itself then drains and stops
    ("draining" with jobs queued). The window is wide with job cgroups (the v1 cgroup
    attach in preexec); this run hits it within seconds. A regression of f727ea0: the
    same test passes at bf2ea82, before claim_unmarked.

    Fix (checked: this test then passes 4 runs of 4): hold one threading.Lock across
    subprocess.Popen in _spawn_blocking (fork to exec) and across find_tree in
    _scan_blocking, so a scan never sees a child before its exec; count a spawn in flight
    (a counter raised before run_in_executor, lowered after it) in the claim_unmarked
    test. Also restore SIGTERM/SIGINT/SIGHUP to SIG_DFL at the top of every preexec_fn
    (isolation.make_preexec; on the vfork path CPython resets them), so a signal before
    exec can never reach the sidecar's own handler through the inherited wakeup fd.
    """
    work = public_dir()
    env = _env(dsn, work)
    jobs = 150  # max_attempts 1: a killed tool fails its job for good
    query(dsn, "INSERT INTO tool_jobs (id, tool, payload, max_attempts, idempotency_key) "
               "SELECT gen_random_uuid(), 'calm', '{\"mode\": \"ok\"}', 1, 'calm-' || g "
               "FROM generate_series(1, $1::int) AS g", jobs)
    done = cli(dsn, "run", "--tool", "calm", "--concurrency", "2", "--drain", "--",
               sys.executable, PROBE, env=env, timeout=90)
    outcomes = Counter((r["state"], r["kind"]) for r in query(
        dsn, "SELECT state, error->>'kind' AS kind FROM tool_jobs WHERE tool = 'calm'"))
    assert parse_events(done.stderr, "draining") == [], f"the sidecar stopped itself: {outcomes}"
    assert outcomes == {("succeeded", None): jobs}, outcomes
    assert done.returncode == 0


def test_a_work_directory_of_this_sidecar_left_behind_is_removed_when_it_stops(
        dsn, public_dir, tmp_path):
    """An attempt's own removal can fail (a sibling tool of its RUN_AS user writes into
    the directory while it is emptied: what made test_link_safety's F15 test leave four
    directories behind: the guardian removes them only after the sidecar has exited, so a
    caller that looks at once may still see them). The sidecar removes whatever of its own
    is left before it exits, once none of its tools runs: here a tool leaves a directory
    named like the sidecar's work directories beside its own, with a file in it, and the
    drain ends with none of them left and ``leftovers_removed`` counting it."""
    work = public_dir()
    tool = tmp_path / "leave.sh"
    tool.write_text('#!/bin/sh\nhere=$(pwd -P); name=${here##*/}\n'
                    'left="${here%/*}/${name%%.j*}.jleft"\n'
                    'mkdir "$left" && echo x > "$left/f" && echo "{}"\n')
    tool.chmod(0o755)
    job = enqueue(dsn, "leave", {}, env=_env(dsn, work, SIDECAR_SANDBOX="off"))
    done = _drain(dsn, _env(dsn, work, SIDECAR_SANDBOX="off"), "leave", command=(str(tool),))
    assert _row(dsn, job)["state"] == "succeeded", _row(dsn, job)["error"]
    assert _keyed(work) == []
    removed = parse_events(done.stderr, "leftovers_removed")
    assert [event["count"] for event in removed] == [1], removed
