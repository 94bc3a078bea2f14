"""Breaking the isolation on purpose (docs/child-process.md, docs/isolation.md):
a hostile tool (tests/tools/breaker.py) and a careless operator against a real
`sidecar run` and a real PostgreSQL. Tests that fail here are reproducers of bugs."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    eventually,
    query,
    short_root,
    wait_attempt_counted,
    wait_until,
)
from kit import job_cgroup_dirs as _cgroup_dirs
from kit import job_row as _row
from kit import journal_details as _journal
from kit import kill_pid as _kill
from kit import pid_alive as _alive

pytestmark = pytest.mark.e2e

BREAKER = str(TOOLS / "breaker.py")
MIB = 1024 * 1024
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="cgroups and RUN_AS need root")






def _env(dsn, work: Path, **extra):
    return base_env(dsn, SIDECAR_WORK_DIR=str(short_root(work)),
                    SIDECAR_STAGE_TIMEOUT_SECONDS="20",
                    **extra)


def _run(dsn, env, tool, *options, command=(BREAKER,), timeout=60):
    return cli(dsn, "run", "--tool", tool, *options, "--drain", "--", *command, env=env,
               timeout=timeout)


def _drain(dsn, env, tool, *options, command=(BREAKER,), timeout=60):
    done = _run(dsn, env, tool, *options, command=command, timeout=timeout)
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-3000:])
    return done








# --- the work directory -------------------------------------------------------------------

def test_a_tool_that_destroys_or_swaps_its_work_dir_harms_nothing_outside_it(dsn, tmp_path):
    """The tool removes its work dir, swaps it for a symlink to a directory outside (after
    moving the real one away), swaps it for a FIFO, or leaves symlinks out of it in
    (read-only) subdirectories. The sidecar's cleanup must not follow any link, must not
    chmod the work root or anything outside, and must not block on the FIFO."""
    work = tmp_path / "work"
    work.mkdir()
    work.chmod(0o755)
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o751)
    (outside / "keep.txt").write_text("not the tool's")
    stash = tmp_path / "stash"
    env = _env(dsn, work)
    jobs = {
        "vanish": enqueue(dsn, "wreck", {"mode": "vanish"}, env=env),
        "swap_link": enqueue(dsn, "wreck", {"mode": "swap_link", "stash": str(stash),
                                            "target": str(outside)}, env=env),
        "swap_fifo": enqueue(dsn, "wreck", {"mode": "swap_fifo"}, "--max-attempts", "1",
                             env=env),
        "inner_links": enqueue(dsn, "wreck", {"mode": "inner_links", "target": str(outside)},
                               env=env),
    }
    _drain(dsn, env, "wreck", timeout=40)  # the FIFO used to hang the cleanup for ever
    for name, job in jobs.items():
        assert _row(dsn, job)["state"] in ("succeeded", "failed"), name
    assert _row(dsn, jobs["vanish"])["state"] == "succeeded"
    assert _row(dsn, jobs["inner_links"])["state"] == "succeeded"
    assert (outside / "keep.txt").read_text() == "not the tool's"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o751
    assert stat.S_IMODE(work.stat().st_mode) == 0o755  # e2670c6 chmod-ed it to 0700
    assert list(work.iterdir()) == []


# --- the tree kill ------------------------------------------------------------------------

@pytest.mark.parametrize("cgroups", [
    pytest.param("auto", marks=needs_root), "off"])
def test_an_escapee_that_drops_its_environment_is_killed_with_the_tree(dsn, tmp_path, cgroups,
                                                                        public_dir):
    """README: the job ends when the tool exits, "leftovers are killed". A descendant that
    double-forks, calls setsid and re-execs itself with an empty environment carries
    neither the session nor the job's SIDECAR_JOB_ID / SIDECAR_FENCING_TOKEN cookie; the
    sidecar (a subreaper) adopts it, but under rlimits nothing then finds it: it lives on
    after the job succeeded, unlimited in time, beside the next attempts."""
    work = public_dir()
    pidfile = tmp_path / "escapee.pid"
    env = _env(dsn, work, SIDECAR_CGROUPS=cgroups)
    job = enqueue(dsn, "flee", {"mode": "escape", "pidfile": str(pidfile), "sleep": 30},
                  env=env)
    try:
        _drain(dsn, env, "flee")
        assert _row(dsn, job)["state"] == "succeeded"
        pid = int(pidfile.read_text())
        assert not _alive(pid), f"escapee {pid} survived the job's tree kill ({cgroups})"
    finally:
        if pidfile.exists():
            _kill(int(pidfile.read_text()))


# A descendant that leaves its job cgroup for a cgroup of its own below it (as the tool's
# user may wherever it can write the job cgroup: root, or a delegated subtree), setsid and
# re-parented to the sidecar: the job cgroup's cgroup.procs no longer lists it.
_HIDE_IN_SUBCGROUP = r"""
setsid sh -c '
  for entry in $(cat /proc/self/cgroup); do
    ctl=${entry#*:}; ctl=${ctl%%:*}; path=${entry#*:*:}
    case "$path" in *sidecar-jobs*) ;; *) continue ;; esac
    case "$ctl" in "") base=/sys/fs/cgroup/unified ;; pids|memory) base=/sys/fs/cgroup/$ctl ;;
                   *) continue ;; esac
    mkdir "$base$path/hide" && echo $$ > "$base$path/hide/cgroup.procs"
    echo "$base$path/hide" >> "$1.cgroups"
  done
  echo $$ > "$1.tmp" && mv "$1.tmp" "$1"
  exec sleep 30' hide "$1" &
while [ ! -s "$1" ]; do sleep 0.05; done
echo '{}'
"""


@needs_root
@pytest.mark.parametrize("prepare", ["true", "false"])
def test_an_escapee_that_leaves_its_job_cgroup_is_killed_with_the_tree(dsn, tmp_path,
                                                                      public_dir, sidecars,
                                                                      prepare):
    """Issue 42's fast tree kill takes an empty job cgroup for a dead tree. A tool that
    joined its cgroup before exec (a prepared launcher, or the preexec_fn that PROCESSES
    brings) may still move a descendant out of it: into a cgroup it makes below its own,
    as root or in a delegated subtree. That escapee carries the job's cookie and was
    adopted by the sidecar: before issue 42 the scan found and killed it when the tool
    exited; an empty cgroup.procs must not hide it while the sidecar runs on."""
    work = public_dir()
    pidfile = tmp_path / "escapee.pid"
    env = _env(dsn, work, SIDECAR_PREPARE=prepare, SIDECAR_PROFILE_HIDE_PROCESSES="64")
    sc = sidecars(dsn, ["/bin/sh", "-c", _HIDE_IN_SUBCGROUP, "hide", str(pidfile)],
                  "--tool", "hide", env=env)
    try:
        job = enqueue(dsn, "hide", {}, env=env)
        wait_until(lambda: _row(dsn, job)["state"] not in ("queued", "running"), 20,
                   what="the job's end")
        assert _row(dsn, job)["state"] == "succeeded"
        pid = int(pidfile.read_text())
        assert eventually(lambda: not _alive(pid), 3), \
            f"escapee {pid} outlived its job (PREPARE={prepare})"
        assert _journal(dsn, job, "child_killed"), "no orphaned_descendants kill journaled"
    finally:
        sc.stop()
        if pidfile.exists():
            _kill(int(pidfile.read_text()))
        cgroups = Path(f"{pidfile}.cgroups")
        for made in cgroups.read_text().split() if cgroups.exists() else []:
            for path in (made, str(Path(made).parent)):
                eventually(lambda p=path: _rmdir(p), 3)


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


# --- the result file ----------------------------------------------------------------------

@needs_root
def test_a_result_file_truncated_while_read_does_not_crash_the_sidecar(dsn, public_dir):
    """RUN_AS tool under rlimits: an escapee (which dropped its environment, so the tree kill
    under rlimits cannot find it; README) keeps the result file open read-write and
    truncates it 5 ms after the sidecar opens it. With the file mapped into memory this
    killed the sidecar with SIGBUS; read into a buffer, the attempt ends cleanly."""
    work = public_dir()
    drop = public_dir(0o777)
    pidfile = drop / "escapee.pid"
    env = _env(dsn, work, SIDECAR_CGROUPS="off", SIDECAR_PROFILE_TRUNC_RUN_AS="65534:65534")
    job = enqueue(dsn, "trunc", {"mode": "escape", "pidfile": str(pidfile), "truncate": True,
                                 "size": 8 * MIB - 1024}, "--max-attempts", "1", env=env)
    try:
        done = _run(dsn, env, "trunc", command=("/usr/bin/python3", BREAKER))
        assert done.returncode != -signal.SIGBUS, "the sidecar died of SIGBUS reading the result"
        assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
        row = _row(dsn, job)
        assert row["state"] in ("succeeded", "failed"), row["state"]
    finally:
        if pidfile.exists():
            _kill(int(pidfile.read_text()))


@needs_root
def test_a_sibling_job_truncating_a_result_file_does_not_crash_the_sidecar(dsn, public_dir):
    """Full isolation (per-job cgroups, RUN_AS, --concurrency 2): a tool can reach a
    sibling's work directory (one RUN_AS user per profile; README). The attacker job opens
    the victim's result file read-write while the victim runs and truncates it 5 ms after
    the sidecar opens it: the victim's attempt ends, the sidecar and the attacker do not."""
    work = public_dir()
    env = _env(dsn, work, SIDECAR_PROFILE_PAIR_RUN_AS="65534:65534")
    victim = enqueue(dsn, "pair", {"mode": "victim", "size": 8 * MIB - 1024},
                     "--max-attempts", "1", env=env)
    attacker = enqueue(dsn, "pair", {"mode": "attacker"}, "--max-attempts", "1", env=env)
    done = _run(dsn, env, "pair", "--concurrency", "2", command=("/usr/bin/python3", BREAKER))
    assert done.returncode != -signal.SIGBUS, "the sidecar died of SIGBUS reading the result"
    assert done.returncode == 0, (done.returncode, done.stderr.decode()[-2000:])
    assert _row(dsn, attacker)["state"] == "succeeded"
    assert _row(dsn, victim)["state"] in ("succeeded", "failed")


def test_odd_result_files_fail_cleanly_and_the_size_cap_is_inclusive(dsn, tmp_path):
    """A FIFO (opened without O_NONBLOCK it would block the sidecar for ever), a directory
    and an empty file fail as bad_result; a file of exactly MAX_RESULT_BYTES is accepted,
    one byte more is refused, like stdout."""
    cap = 1000
    exact = '{"a": "' + "x" * (cap - 9) + '"}'
    assert len(exact) == cap
    work = tmp_path / "work"
    env = _env(dsn, work, SIDECAR_PROFILE_ODD_MAX_RESULT_BYTES=str(cap))
    jobs = {kind: enqueue(dsn, "odd", {"mode": "result_kind", "kind": kind}, env=env)
            for kind in ("fifo", "dir", "empty")}
    at_cap = enqueue(dsn, "odd", {"mode": "result_text", "text": exact}, env=env)
    over = enqueue(dsn, "odd", {"mode": "result_text", "text": exact + " "}, env=env)
    _drain(dsn, env, "odd", timeout=30)
    for kind, job in jobs.items():
        row = _row(dsn, job)
        assert (row["state"], row["error"]["kind"]) == ("failed", "bad_result"), kind
        assert row["result"] is None, kind
    assert _row(dsn, at_cap)["state"] == "succeeded"
    row = _row(dsn, over)
    assert row["state"] == "failed" and "MAX_RESULT_BYTES" in row["error"]["message"]
    assert list(work.iterdir()) == []


def test_a_result_file_does_not_lift_the_stdout_cap(dsn, tmp_path):
    """README: with a result file, stdout is ignored as a result, but its MAX_RESULT_BYTES
    cap still stops a tool flooding it: more than the cap on stdout fails as
    result_too_large, whatever the file holds; within the cap the file is the result."""
    env = _env(dsn, tmp_path / "work", SIDECAR_PROFILE_CHATTY_MAX_RESULT_BYTES="1000")
    flood = enqueue(dsn, "chatty", {"mode": "result_text", "text": '{"ok": true}',
                                    "stdout": "log line\n" * 200}, env=env)
    quiet = enqueue(dsn, "chatty", {"mode": "result_text", "text": '{"ok": true}',
                                    "stdout": "log line\n" * 10}, env=env)
    _drain(dsn, env, "chatty")
    row = _row(dsn, flood)
    assert row["state"] == "failed" and row["error"]["kind"] == "result_too_large"
    row = _row(dsn, quiet)
    assert row["state"] == "succeeded" and row["result"] == {"ok": True}, row["error"]


# --- limits -------------------------------------------------------------------------------

@pytest.mark.parametrize("cgroups", [
    pytest.param("auto", marks=needs_root), "off"])
def test_cpu_seconds_counts_the_cpu_of_children_the_tool_already_reaped(dsn, tmp_path,
                                                                         cgroups):
    """README: "CPU time of the whole tree past CPU_SECONDS fails cpu_limit". A tool that
    runs its work in short-lived workers, one after another, each under RLIMIT_CPU, uses
    3 x 0.6 s against a limit of 1 s. With a cgroup, cpu.stat counts exited processes; under
    rlimits watch_cpu/tree_activity sums only the *live* tree (cpu_times().user+system,
    never children_user/children_system), so the job succeeds."""
    env = _env(dsn, tmp_path / "work", SIDECAR_CGROUPS=cgroups,
               SIDECAR_PROFILE_WORKERS_CPU_SECONDS="1")
    job = enqueue(dsn, "workers", {"mode": "cpu_workers", "workers": 3, "each": 0.6},
                  "--max-attempts", "1", env=env)
    _drain(dsn, env, "workers")
    row = _row(dsn, job)
    journal = _journal(dsn, job, "job_succeeded") + _journal(dsn, job, "job_failed")
    assert row["state"] == "failed" and row["error"]["kind"] == "cpu_limit", (
        row["state"], row["error"], journal)


@needs_root
def test_run_as_root_is_refused_so_processes_cannot_pass_as_enforced(dsn, tmp_path):
    """check_profile accepts PROCESSES without a pids cgroup only with RUN_AS, because
    RLIMIT_NPROC does not bind root. RUN_AS=0 (or 0:0) is root: it used to satisfy the
    check and let 40 forks through a limit of 8. Every command now refuses it."""
    for run_as in ("0", "0:0"):
        env = _env(dsn, tmp_path / "work", SIDECAR_CGROUPS="off",
                   SIDECAR_PROFILE_FORKS_PROCESSES="8", SIDECAR_PROFILE_FORKS_RUN_AS=run_as)
        for args in (("config",), ("run", "--tool", "forks", "--drain", "--", BREAKER)):
            done = cli(dsn, *args, env=env)
            err = done.stderr.decode()
            assert done.returncode == 2 and "SIDECAR_PROFILE_FORKS_RUN_AS" in err, err
            assert "root" in err and "Traceback" not in err


# --- careless configuration ---------------------------------------------------------------

def test_a_relative_work_dir_still_gives_the_tool_usable_paths(dsn, tmp_path):
    """SIDECAR_WORK_DIR=work (relative) passes every check, but SIDECAR_JOB_DIR,
    SIDECAR_RESULT_FILE, TMPDIR and SIDECAR_CHECKPOINT_FILE are then relative paths, and
    the tool's current directory is already the job dir: work/job-.../result.json resolves
    to job-.../work/job-.../result.json, which does not exist. A tool that follows the
    contract and writes its result file fails."""
    env = _env(dsn, Path("work"))
    job = enqueue(dsn, "rel", {"mode": "result_text", "text": '{"ok": true}'},
                  "--max-attempts", "1", env=env)
    done = subprocess.run([sys.executable, "-m", "sidecar", "run", "--tool", "rel", "--drain",
                           "--", BREAKER], env=env, cwd=tmp_path, capture_output=True,
                          timeout=60)
    assert done.returncode in (0, 2), done.stderr.decode()[-2000:]
    if done.returncode == 2:  # refused at start, naming the variable: fine too
        assert "SIDECAR_WORK_DIR" in done.stderr.decode()
        return
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == {"ok": True}


def test_a_run_as_uid_beyond_uid_t_is_refused_not_a_supervisor_crash(dsn, tmp_path):
    """RUN_AS=9999999999 used to pass `sidecar config` and the start of `sidecar run`, then
    crash the supervisor in os.chown (OverflowError); 4294967295 is (uid_t)-1, "leave
    unchanged" to the kernel. Both are refused as configuration errors now."""
    for run_as in ("9999999999", "4294967295", "1000:4294967295"):
        env = _env(dsn, tmp_path / "work", SIDECAR_PROFILE_UID_RUN_AS=run_as)
        done = cli(dsn, "config", "--tool", "uid", env=env)
        err = done.stderr.decode()
        assert done.returncode == 2 and f"SIDECAR_PROFILE_UID_RUN_AS='{run_as}'" in err, err


@needs_root
def test_a_work_dir_the_run_as_user_cannot_enter_is_refused_at_start(dsn, public_dir):
    """SIDECAR_WORK_DIR under a 0700 root directory (pytest's tmp_path, /root/..., a root
    made with umask 077): check_work_dir probes it as root and passes. The child chdir()s
    into its job dir before dropping to RUN_AS, so it starts, but every absolute path it
    was given (SIDECAR_RESULT_FILE, TMPDIR, SIDECAR_CHECKPOINT_FILE) is EACCES: a
    contract-following tool fails with PermissionError on every attempt."""
    locked = public_dir(0o700)  # root's, mode 0700
    env = _env(dsn, locked / "work", SIDECAR_PROFILE_LOCKED_RUN_AS="65534:65534")
    job = enqueue(dsn, "locked", {"mode": "result_text", "text": '{"ok": true}'},
                  "--max-attempts", "1", env=env)
    done = _run(dsn, env, "locked", command=("/usr/bin/python3", BREAKER))
    if done.returncode == 2:
        assert "SIDECAR_WORK_DIR" in done.stderr.decode()
        return
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]


# --- a SIGKILLed sidecar ------------------------------------------------------------------



@needs_root
def test_a_sigkilled_sidecars_job_cgroups_and_work_dir_are_swept_at_the_next_start(
        dsn, tmp_path, sidecars, public_dir):
    """kill -9 of the sidecar mid-job: the kernel and the guardian kill the tool; the job
    cgroups stay (empty) and the next start sweeps them (that works). The attempt's work
    directory stays too, and nothing ever removes it: after a container restart (which
    keeps an emptyDir) every hard-killed attempt leaks its files for good."""
    work = public_dir()
    pidfile = tmp_path / "tool.pid"
    # Limits on memory and processes: the job joins all three hierarchies (v1 ones are
    # joined only for a limit they enforce).
    env = _env(dsn, work, SIDECAR_PROFILE_CRASH_MEMORY_BYTES=str(2**30),
               SIDECAR_PROFILE_CRASH_PROCESSES="512")
    job = enqueue(dsn, "crash", {"mode": "hang_first", "pidfile": str(pidfile)},
                  "--max-attempts", "2", env=env)
    first = sidecars(dsn, [BREAKER], "--tool", "crash", env=env)
    tool = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 20,
                          what="the first attempt's tool"))
    cgroup_dirs = _cgroup_dirs(tool)
    assert len(cgroup_dirs) == 3, cgroup_dirs
    wait_attempt_counted(dsn, job)  # else its expiry gives the attempt back (F16)
    first.proc.kill()
    first.proc.wait(5)
    wait_until(lambda: not _alive(tool), 5, what="the tool's death")
    _drain(dsn, env, "crash")  # claims the job again once the lease expired
    row = _row(dsn, job)
    assert row["state"] == "succeeded" and row["attempt"] == 2, row
    assert [d for d in cgroup_dirs if d.exists()] == []
    assert list(work.iterdir()) == [], "the killed attempt's work dir was never removed"


@needs_root
def test_a_sigkilled_sidecars_escapee_dies_with_its_job_cgroup(dsn, tmp_path, sidecars,
                                                              public_dir):
    """With per-job cgroups the normal tree kill reaches an escapee that dropped its
    environment (cgroup.kill). When the sidecar is SIGKILLed, only the guardian is left,
    and it looks for SIDECAR_OWNER_ID in environments, never in the job cgroups: the
    escapee lives on in a job cgroup that the next start cannot remove (busy)."""
    work = public_dir()
    pidfile = tmp_path / "escapee.pid"
    env = _env(dsn, work)
    enqueue(dsn, "strand", {"mode": "escape", "pidfile": str(pidfile), "sleep": 30,
                            "hang": True, "once": True}, "--max-attempts", "2", env=env)
    first = sidecars(dsn, [BREAKER], "--tool", "strand", env=env)
    escapee = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 20,
                             what="the escapee"))
    try:
        assert any("sidecar-jobs/" in line and ".job-" in line
                   for line in Path(f"/proc/{escapee}/cgroup").read_text().splitlines())
        first.proc.kill()
        first.proc.wait(5)
        # The guardian's sweep takes well under a second: 3 s at the most.
        assert eventually(lambda: not _alive(escapee), 3), \
            "the escapee outlived the SIGKILLed sidecar"
    finally:
        _kill(escapee)


@needs_root
def test_concurrent_jobs_each_get_their_own_cgroup_limits_and_figures(dsn, tmp_path):
    """--concurrency 3 under one profile with memory, CPU and process limits: a memory hog,
    a CPU spinner and a well-behaved job run side by side; each fails (or not) on its own
    limit only, and each journal entry carries its own cgroup's figures."""
    work = tmp_path / "work"
    env = _env(dsn, work, SIDECAR_PROFILE_MIX_MEMORY_BYTES=str(64 * MIB),
               SIDECAR_PROFILE_MIX_CPU_SECONDS="1.5", SIDECAR_PROFILE_MIX_PROCESSES="16")
    hog = enqueue(dsn, "mix", {"mode": "memory_hog"}, "--max-attempts", "1", env=env)
    spin = enqueue(dsn, "mix", {"mode": "cpu_spin"}, "--max-attempts", "1", env=env)
    calm = enqueue(dsn, "mix", {"mode": "inspect"}, "--max-attempts", "1", env=env)
    _drain(dsn, env, "mix", "--concurrency", "3", command=(str(TOOLS / "hostile.py"),))
    assert _row(dsn, hog)["error"]["kind"] == "memory_limit", _row(dsn, hog)["error"]
    assert _row(dsn, spin)["error"]["kind"] == "cpu_limit", _row(dsn, spin)["error"]
    row = _row(dsn, calm)
    assert row["state"] == "succeeded", row["error"]
    # Its own cgroup: the one its attempt's journal names (named after the job, or the
    # slot's prepared one, job-p<slot>-<n>, when a prepared attempt took it), which is
    # neither the hog's nor the spinner's.
    cgroups = {job: _journal(dsn, job, "tool_request_started")[0]["cgroup"]
               for job in (hog, spin, calm)}
    assert len(set(cgroups.values())) == 3, cgroups
    assert cgroups[calm] in row["result"]["cgroup"], (cgroups, row["result"]["cgroup"])
    [hog_summary] = _journal(dsn, hog, "job_failed")
    [spin_summary] = _journal(dsn, spin, "job_failed")
    [calm_summary] = _journal(dsn, calm, "job_succeeded")
    assert 32 * MIB < hog_summary["peak_memory_bytes"] <= 65 * MIB
    assert hog_summary.get("cpu_seconds", 0) < 1.5
    assert 1.5 <= spin_summary["cpu_seconds"] < 6
    assert spin_summary["peak_memory_bytes"] < 32 * MIB
    assert calm_summary["cpu_seconds"] < 1 and calm_summary["peak_memory_bytes"] < 32 * MIB
    claimed = query(dsn, "SELECT count(*) AS n FROM tool_job_events WHERE event = "
                         "'tool_request_started'")[0]["n"]
    assert claimed == 3
    assert list(work.iterdir()) == []


@needs_root
def test_a_run_as_tool_cannot_move_itself_out_of_its_job_cgroup(dsn, public_dir):
    """As root a tool can write its pid into any cgroup.procs (README: root is not
    contained); as its RUN_AS user every such write is refused and the tool stays in
    its job cgroups, so cgroup.kill and the limits still hold it."""
    work = public_dir()
    env = _env(dsn, work, SIDECAR_PROFILE_CGX_RUN_AS="65534:65534",
               SIDECAR_PROFILE_CGX_MEMORY_BYTES=str(2**30), SIDECAR_PROFILE_CGX_PROCESSES="512")
    job = enqueue(dsn, "cgx", {"mode": "cgroup_escape"}, env=env)
    _drain(dsn, env, "cgx", command=("/usr/bin/python3", BREAKER))
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    moved = row["result"]["moved"]
    assert "moved" not in moved.values(), moved
    lines = [line for line in row["result"]["cgroup"].splitlines()
             if line.startswith("0::") or ":memory:" in line or ":pids:" in line]
    assert len(lines) == 3 and all(f".job-{job}-1" in line for line in lines), lines


@needs_root
def test_processes_limits_processes_not_threads(dsn, tmp_path):
    """PROCESSES is documented as "processes of the tool's tree (cgroup pids.max)", but
    pids.max (like RLIMIT_NPROC) counts tasks, threads included: one process starting 24
    threads under PROCESSES=16 fails as process_limit with "the kernel refused 1 fork(s)
    at its limit of 16 processes" - while it never forked. A browser or JVM (hundreds of
    threads) hits this at once. The failure should say that threads count."""
    env = _env(dsn, tmp_path / "work", SIDECAR_PROFILE_THREADS_PROCESSES="16")
    job = enqueue(dsn, "threads", {"mode": "threads", "n": 24}, "--max-attempts", "1",
                  env=env)
    _drain(dsn, env, "threads")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "process_limit", row["error"]
    assert "thread" in row["error"]["message"], row["error"]["message"]


def test_a_memory_limit_too_small_to_start_the_tool_says_so_under_rlimits(dsn, tmp_path):
    """MEMORY_BYTES=1000000 under rlimits (RLIMIT_AS): the tool cannot even start. Via its
    #!/usr/bin/env shebang the loader fails ("failed to map segment from shared object",
    exit 127: kind exit_code); run as /usr/bin/python3 directly it dies of SIGSEGV (kind
    signal). Either way it is retried like a crash and nothing points at MEMORY_BYTES.
    (With a memory cgroup the same setting fails as memory_limit.)"""
    env = _env(dsn, tmp_path / "work", SIDECAR_CGROUPS="off",
               SIDECAR_PROFILE_TINY_MEMORY_BYTES="1000000")
    job = enqueue(dsn, "tiny", {"mode": "result_text", "text": "{}"}, "--max-attempts", "1",
                  env=env)
    _drain(dsn, env, "tiny")
    error = _row(dsn, job)["error"]
    assert error["kind"] == "memory_limit" or "MEMORY_BYTES" in error["message"], error


@pytest.mark.parametrize("var,value", [("OPEN_FILES", str(2 ** 63)),
                                       ("CPU_SECONDS", "1e19")])
def test_a_limit_too_large_for_setrlimit_names_itself(dsn, tmp_path, var, value):
    """Both values used to pass `sidecar config`; then setrlimit raised OverflowError in the
    child and the attempt failed as spawn_failed "Exception occurred in preexec_fn.",
    naming nothing. They are configuration errors now, named by every command."""
    env = _env(dsn, tmp_path / "work", **{f"SIDECAR_PROFILE_HUGE_{var}": value})
    for args in (("config",), ("enqueue", "huge"), ("run", "--tool", "huge", "--", BREAKER)):
        done = cli(dsn, *args, env=env)
        err = done.stderr.decode()
        assert done.returncode == 2 and f"SIDECAR_PROFILE_HUGE_{var}" in err, (args, err)


def test_open_files_above_the_kernels_cap_is_refused_at_start(dsn, tmp_path):
    """OPEN_FILES above fs.nr_open can never be granted: every attempt exited 126 and was
    retried. `sidecar run` refuses it at start; `sidecar config` shows why."""
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    env = _env(dsn, tmp_path / "work", SIDECAR_PROFILE_HUGE_OPEN_FILES=str(nr_open + 1))
    done = cli(dsn, "run", "--tool", "huge", "--drain", "--", BREAKER, env=env)
    assert done.returncode == 2 and "fs.nr_open" in done.stderr.decode()
    [profile] = orjson.loads(cli(dsn, "config", env=env).stdout)["profiles"]
    assert "fs.nr_open" in profile["isolation_error"]
