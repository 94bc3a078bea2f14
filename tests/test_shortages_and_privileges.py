"""Cases F19 and F23: what the host runs short of, and what a tool gains, must neither fail
a job for good nor let a process escape the tree kill unreported."""

from __future__ import annotations

import asyncio
import errno
import os
import resource
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from kit import (
    TOOLS,
    base_env,
    enqueue,
    job_row,
    journal_details,
    kill_pid,
    pid_alive,
    python_for,
    scraped_metric,
    short_root,
    wait_until,
)
from sidecar.protocol.shortage import (
    PAUSE_BASE_SECONDS,
    PAUSE_MAX_SECONDS,
    ClaimPause,
    shortage_errno,
)
from sidecar.worker.child import Child, SpawnSetupFailed, SpawnShortage
from sidecar.worker.isolation import make_preexec

PIDS_ROOT = Path("/sys/fs/cgroup/pids")
TOOL_UID = 4243  # the unprivileged user the F23 sidecar runs as

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, uids, setuid)")


# --- F19: a transient shortage is never a permanent failure ------------------------------

@pytest.mark.unit
def test_shortage_errnos_are_transient_and_program_errors_are_not():
    """Case F19, kind "a transient shortage is never a permanent failure": the errors of a
    host that ran short (EAGAIN, ENOMEM, EMFILE, ENFILE, ENOSPC, a thread that could not
    start) are shortages; the errors of the program itself (ENOENT, EACCES, ENOEXEC) and
    anything else are not."""
    for number in (errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC):
        assert shortage_errno(OSError(number, os.strerror(number))) == errno.errorcode[number]
    assert shortage_errno(RuntimeError("can't start new thread")) == "EAGAIN"
    for number in (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.E2BIG, errno.EPERM):
        assert shortage_errno(OSError(number, os.strerror(number))) is None
    assert shortage_errno(ValueError("bad")) is None


@pytest.mark.unit
def test_claim_pause_doubles_while_shortages_repeat_and_resets_once_a_tool_starts():
    """Case F19: each shortage in a row doubles the claim pause up to its cap; a started
    tool resets it."""
    now = [100.0]
    pause = ClaimPause(clock=lambda: now[0])
    assert pause.remaining() == 0.0
    assert pause.begin() == PAUSE_BASE_SECONDS
    assert pause.remaining() == PAUSE_BASE_SECONDS
    assert pause.begin() == 2 * PAUSE_BASE_SECONDS
    for _ in range(20):
        last = pause.begin()
    assert last == PAUSE_MAX_SECONDS
    now[0] += PAUSE_MAX_SECONDS
    assert pause.remaining() == 0.0
    pause.started()
    assert pause.begin() == PAUSE_BASE_SECONDS


@pytest.mark.unit
def test_spawn_without_descriptors_is_a_shortage_not_a_spawn_failure():
    """Case F19: a spawn that cannot make its pipes (EMFILE: the sidecar's descriptor table
    is full) raises SpawnShortage naming EMFILE, not the permanent SpawnFailed. A real
    spawn with the process's RLIMIT_NOFILE lowered for the duration."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def spawn_with_a_full_table() -> SpawnShortage | None:
        held: list[int] = []
        try:
            while True:  # the event loop is up: only the spawn needs descriptors now
                try:
                    held.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            await Child.spawn(["true"], {"PATH": os.environ["PATH"]}, b"", 1024,
                              lambda line: None, {"SIDECAR_JOB_ID": "x"})
        except SpawnShortage as exc:
            return exc
        finally:
            for fd in held:
                os.close(fd)
        return None

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        caught = asyncio.run(spawn_with_a_full_table())
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert caught is not None and caught.errno_name == "EMFILE"


async def _spawn_joining(procs_file: str):
    """Spawn ``true`` through the real ``preexec_fn`` (sidecar.worker.isolation.make_preexec),
    joining ``procs_file`` as its cgroup: the exception raised, or the child's exit status."""
    try:
        child = await Child.spawn(
            ["true"], {"PATH": os.environ["PATH"]}, b"", 1024, lambda line: None,
            {"SIDECAR_JOB_ID": "x"},
            make_preexec=lambda pid, report: make_preexec(pid, [procs_file], [], None, report))
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
        return exc
    return await asyncio.wait_for(child.exited, 10)


@pytest.mark.e2e
def test_shortage_between_fork_and_exec_is_a_shortage_not_an_exit_status(tmp_path):
    """Case F19, kind "a transient shortage is never a permanent failure", where the
    shortage is met in the child between fork and exec: its ``preexec_fn`` joins the job
    cgroup, sets rlimits and takes the RUN_AS identity, and any of these can meet EAGAIN,
    ENOMEM, EMFILE or ENOSPC. It used to exit 126, read as the tool's exit status (an
    attempt spent, the errno lost). Now the child reports the errno and the step on a pipe
    of its own and the spawn raises SpawnShortage naming both. The join's write here goes
    to /dev/full, whose every write fails with ENOSPC, through the real preexec code. A
    step that fails for another reason (a cgroup that is gone: ENOENT) is
    SpawnSetupFailed naming the step, never an exit status nor a failure of the
    program; a join that works starts the tool."""
    short = asyncio.run(_spawn_joining("/dev/full"))
    assert isinstance(short, SpawnShortage), short
    assert short.errno_name == "ENOSPC" and "join cgroup /dev/full" in short.message
    gone = asyncio.run(_spawn_joining(str(tmp_path / "gone" / "cgroup.procs")))
    assert isinstance(gone, SpawnSetupFailed), gone
    assert "join cgroup" in gone.message and "gone" in gone.message, gone.message
    procs = tmp_path / "cgroup.procs"  # a plain file: the join writes "0" into it
    procs.write_text("")
    assert asyncio.run(_spawn_joining(str(procs))) == 0
    assert procs.read_text() == "0"


@pytest.fixture
def pids_cgroup():
    """A v1 pids cgroup of our own (the "pod"), removed at the end once empty."""
    if os.geteuid() != 0 or not (PIDS_ROOT / "cgroup.procs").exists():
        pytest.skip("needs root and the v1 pids controller at /sys/fs/cgroup/pids")
    path = PIDS_ROOT / f"sidecar-test-f19-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    wait_until(lambda: not (path / "cgroup.procs").read_text().split(), 15,
               what="the test pod's cgroup to empty")
    for sub in sorted(path.rglob("*"), reverse=True):
        if sub.is_dir():
            sub.rmdir()
    path.rmdir()


@pytest.mark.e2e
def test_pids_limit_reached_by_another_tool_releases_the_attempt_unspent(
        pids_cgroup, dsn, sidecars, tmp_path):
    """Case F19, kind "a transient shortage is never a permanent failure": one tool forks
    up to the pod's pids limit (a pids cgroup holding the sidecar and its tools); a job
    claimed meanwhile cannot be started (fork: EAGAIN). It is not failed: the lease is
    released without spending the attempt, ``attempt_shortage`` is journaled with the
    errno, counted in sidecar_attempt_shortages_total, and the sidecar pauses claiming;
    once the shortage clears the job runs and succeeds on its first attempt."""
    (pids_cgroup / "pids.max").write_text("60\n")
    # Cold starts: an attempt prepared before the shortage (issue 42) would need no fork
    # and run; this is about the spawn that meets it.
    env = base_env(dsn, SIDECAR_MAX_ATTEMPTS="1", SIDECAR_PREPARE="false")
    launcher = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(pids_cgroup)]
    sc = sidecars(dsn, [str(TOOLS / "fork_fill.py")], "--tool", "fill", "--concurrency", "2",
                  env=env, launcher=launcher)
    base = "http://" + sc.wait_event("worker_started")["http_addr"]
    ready, release = tmp_path / "ready", tmp_path / "release"
    filler = enqueue(dsn, "fill", {"fill": {"ready": str(ready), "release": str(release)}},
                     env=env)
    wait_until(ready.exists, 20, what="the filler to reach the pids limit")
    late = enqueue(dsn, "fill", {}, env=env)
    try:
        shortage = sc.wait_event("attempt_shortage", 20, job_id=late)
        assert shortage["errno"] == "EAGAIN" and shortage["stage"] == "spawn"
        released = sc.wait_event("lease_released", 10, job_id=late)
        assert released["reason"] == "shortage"
        row = job_row(dsn, late)
        assert row["state"] != "failed", row["error"]
        assert row["attempt"] <= 1  # 0 while queued, 1 while claimed again: never spent
        journaled = journal_details(dsn, late, "attempt_shortage")
        assert journaled and journaled[0]["errno"] == "EAGAIN"
        assert [d["reason"] for d in journal_details(dsn, late, "lease_released")][0] \
            == "shortage"
        assert scraped_metric(base, "sidecar_attempt_shortages_total", tool="fill",
                              errno="EAGAIN") >= 1
    finally:
        release.touch()
    wait_until(lambda: job_row(dsn, filler)["state"] == "succeeded", 20,
               what="the filler to finish")
    wait_until(lambda: job_row(dsn, late)["state"] == "succeeded", 60,
               what="the late job to run once the shortage cleared")
    row = job_row(dsn, late)
    assert row["attempt"] == 1 and row["error"] is None
    assert not [e for e in sc.events("job_failed") if e.get("job_id") == late]


# --- F23: a tool that gains privileges cannot escape the tree kill -----------------------

_HELPER_SOURCE = r"""
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char tmp[4096];
    int r = setuid(0);
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
    FILE *f = fopen(tmp, "w");
    if (!f) return 1;
    fprintf(f, "%d %d %d\n", (int)getpid(), r, (int)geteuid());
    fclose(f);
    rename(tmp, argv[1]);
    for (;;) pause();
}
"""


@pytest.fixture
def setuid_helper(public_dir):
    """A setuid-root helper built now (gcc), in a directory on a filesystem that honours
    setuid, that calls setuid(0) and writes "pid result euid" to the path it is given; and
    a directory (mode 1777) for its reports. Helpers still alive at the end are killed by
    the pid they reported (only what this test started)."""
    if os.geteuid() != 0 or shutil.which("gcc") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, gcc and setpriv")
    where = public_dir(0o755)
    source = where / "helper.c"
    source.write_text(_HELPER_SOURCE)
    binary = where / "helper"
    subprocess.run(["gcc", "-O0", "-o", str(binary), str(source)], check=True)
    os.chown(binary, 0, 0)
    binary.chmod(0o4755)
    if "nosuid" in subprocess.run(["findmnt", "-no", "OPTIONS", "-T", str(binary)],
                                  capture_output=True, text=True).stdout.split(","):
        pytest.skip(f"{where} is mounted nosuid")
    reports = public_dir(0o1777)
    started: list[int] = []

    def report(path: Path) -> tuple[int, int, int]:
        text = wait_until(lambda: path.exists() and path.read_text(), 20,
                          what="the helper's report")
        pid, result, euid = (int(x) for x in text.split())
        started.append(pid)
        return pid, result, euid

    yield binary, reports, report
    for pid in started:
        kill_pid(pid)


def _unprivileged_sidecar(dsn, proxy, sidecars, public_dir, tool: str, **extra: str):
    """A sidecar running as TOOL_UID (as in the field: not root, so it can signal only
    its own user's processes), with its work directory writable by that user. It reaches
    the database over TCP through the test's proxy: the embedded server's socket
    directory is closed to other users."""
    from netproxy import through

    side_dsn = through(dsn, proxy.port)
    work = public_dir(0o755)
    os.chown(work, TOOL_UID, TOOL_UID)
    # HOME: its own, as a user's (asyncpg looks for client certificates under it).
    env = base_env(side_dsn, SIDECAR_WORK_DIR=str(short_root(work)),
                   SIDECAR_KILL_GRACE_SECONDS="0.5", HOME=str(work), **extra)
    python, python_env = python_for(TOOL_UID)
    env.update(python_env)
    launcher = ["setpriv", f"--reuid={TOOL_UID}", f"--regid={TOOL_UID}", "--clear-groups"]
    return sidecars(side_dsn, [python, str(TOOLS / "setuid_launcher.py")], "--tool", tool,
                    env=env, launcher=launcher, python=python)


@pytest.mark.e2e
def test_setuid_helper_stays_unprivileged_and_dies_with_the_tree(
        dsn, proxy, sidecars, public_dir, setuid_helper):
    """Case F23, kind "a tool that gains privileges cannot escape the tree kill": the
    sidecar runs as an unprivileged user; its tool starts a setuid-root helper that calls
    setuid(0) and is left running when the tool exits. Every tool starts with
    PR_SET_NO_NEW_PRIVS, so the setuid bit is ignored: the helper stays the tool's user,
    its setuid(0) fails, and the tree kill ends it."""
    binary, reports, report = setuid_helper
    sc = _unprivileged_sidecar(dsn, proxy, sidecars, public_dir, "suid")
    path = reports / "default"
    job = enqueue(dsn, "suid", {"helper": str(binary), "report": str(path)})
    pid, result, euid = report(path)
    assert (result, euid) == (-1, TOOL_UID)
    wait_until(lambda: job_row(dsn, job)["state"] == "succeeded", 20, what="the job to end")
    wait_until(lambda: not pid_alive(pid), 10, what="the helper to be killed")
    killed = journal_details(dsn, job, "child_killed")
    assert killed and killed[-1]["survivors"] == 0 and killed[-1]["killed"] >= 1
    assert sc.proc.poll() is None


@pytest.mark.e2e
def test_unsignallable_process_of_the_tree_is_a_survivor(
        dsn, proxy, sidecars, public_dir, setuid_helper):
    """Case F23: a process of the tree the sidecar may not signal (a profile that opts out
    with ALLOW_NEW_PRIVS, so the setuid-root helper really becomes root, unreadable and
    out of reach of an unprivileged sidecar without a cgroup) is reported as a survivor
    (journal ``child_killed`` with survivors and unsignalled), never as "0 survivors"."""
    binary, reports, report = setuid_helper
    sc = _unprivileged_sidecar(dsn, proxy, sidecars, public_dir, "suid",
                               SIDECAR_PROFILE_SUID_ALLOW_NEW_PRIVS="true")
    path = reports / "opted-out"
    job = enqueue(dsn, "suid", {"helper": str(binary), "report": str(path)})
    pid, result, euid = report(path)
    assert (result, euid) == (0, 0)  # the opt-out works: it became root
    wait_until(lambda: job_row(dsn, job)["state"] == "succeeded", 30, what="the job to end")
    killed = wait_until(lambda: journal_details(dsn, job, "child_killed"), 10,
                        what="child_killed in the journal")
    assert killed[-1]["survivors"] >= 1, killed
    assert killed[-1].get("unsignalled", 0) >= 1, killed
    assert pid_alive(pid)  # it is out of the sidecar's reach: the report is the truth
    logged = sc.wait_event("child_killed", 5, job_id=job)
    assert pid in logged["survivors"]
