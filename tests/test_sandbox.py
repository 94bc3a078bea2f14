"""The child-process contract through the bubblewrap sandbox (SANDBOX=auto, issue 25
point 1): exit status and signal as the tool's own, the SIGTERM grace before the
namespace is killed, stdin and stdout, a writable HOME, TMPDIR and work directory on a
read-only system, its own PID namespace, the guard reachable (NETWORK=host), no network
with NETWORK=none but the guard over the attempt's own Unix socket (issue 41), a sandbox
that cannot start failing sandbox_failed, and
`sidecar config` saying whether the sandbox is on."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_row,
    journal_details,
    sandbox_extra_paths,
    wait_until,
)

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.path.exists("/usr/bin/bwrap"), reason="needs bubblewrap (docs/development.md)"),
]

TOOL = [sys.executable, str(TOOLS / "sandbox_probe.py")]


def _env(dsn: str, **extra: str) -> dict[str, str]:
    binds = ",".join(p for p in (sandbox_extra_paths(), extra.pop("SIDECAR_EXTRA_PATHS", ""))
                     if p)
    env = base_env(dsn, SIDECAR_SANDBOX="required", SIDECAR_MAX_ATTEMPTS="1", **extra)
    if binds:
        env["SIDECAR_EXTRA_PATHS"] = binds
    return env


def _ended(dsn: str, job: str, timeout: float = 30) -> dict:
    wait_until(lambda: job_row(dsn, job)["state"] in ("succeeded", "failed"), timeout,
               what=f"job {job} to end")
    row = job_row(dsn, job)
    for key in ("result", "error"):
        if isinstance(row[key], str | bytes):
            row[key] = orjson.loads(row[key])
    return row


def test_exit_status_and_signal_pass_through_the_sandbox(dsn, sidecars):
    """bwrap reports a death by signal N as 128 + N; the sidecar reads it back, so a
    SIGSEGV is kind ``signal`` 11 and an exit 3 is ``exit_code`` 3, as without it."""
    sc = sidecars(dsn, TOOL, "--tool", "sbx", "--concurrency", "2", env=_env(dsn))
    code = enqueue(dsn, "sbx", {"mode": "exit", "code": 3})
    segv = enqueue(dsn, "sbx", {"mode": "signal", "signal": int(signal.SIGSEGV)})
    error = _ended(dsn, code)["error"]
    assert (error["kind"], error["exit_code"]) == ("exit_code", 3), error
    error = _ended(dsn, segv)["error"]
    assert (error["kind"], error["signal"]) == ("signal", int(signal.SIGSEGV)), error
    assert sc.events("worker_started")[0]["sandbox"] == "bwrap"


def test_a_stage_timeout_gives_the_sandboxed_tool_its_sigterm_grace(dsn, sidecars):
    """The tree kill sends SIGTERM to the tool's processes, not to bwrap (whose death
    would SIGKILL the namespace at once): the tool's handler runs within the grace."""
    sidecars(dsn, TOOL, "--tool", "sbx",
             env=_env(dsn, SIDECAR_STAGE_TIMEOUT_SECONDS="1", SIDECAR_LEASE_SECONDS="10",
                      SIDECAR_KILL_GRACE_SECONDS="3"))
    job = enqueue(dsn, "sbx", {"mode": "term_trap"})
    error = _ended(dsn, job)["error"]
    assert error["kind"] == "stage_timeout", error
    assert "got SIGTERM" in (error.get("stderr_tail") or ""), error


def test_inside_the_sandbox_the_contract_holds(dsn, sidecars):
    """Payload on stdin, result on stdout; its own PID namespace (it is PID 2, under
    bwrap's init); HOME, TMPDIR and the work directory writable, /usr not; the guard
    answers over the loopback (NETWORK=host)."""
    sidecars(dsn, TOOL, "--tool", "sbx", env=_env(dsn))
    job = enqueue(dsn, "sbx", {"mode": "inside", "n": 12345678901234567890})
    row = _ended(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    seen = row["result"]
    assert seen["payload"]["n"] == 12345678901234567890
    assert seen["pid"] == 2 and max(seen["pids"]) < 10, seen
    assert (seen["home"], seen["tmpdir"], seen["job_dir"], seen["usr"]) == (
        True, True, True, False), seen
    # It answers (200, or 409 lease_ending with the suite's 3 s lease): it is reachable.
    assert seen["guard_status"] in (200, "409"), seen


def test_network_none_has_no_network_and_no_guard_url(dsn, sidecars):
    """NETWORK=none: an empty network namespace, so not even the database's port on the
    loopback answers; the tool gets no guard URL (it could not reach it: the guard is its
    Unix socket then, below)."""
    parts = urlsplit(dsn)
    port = parts.port or 5432
    sidecars(dsn, TOOL, "--tool", "sbx", env=_env(dsn, SIDECAR_NETWORK="none"))
    job = enqueue(dsn, "sbx", {"mode": "inside", "connect": f"127.0.0.1:{port}"})
    row = _ended(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"]["connect"] != "connected"
    assert row["result"]["guard_url"] is None


def test_network_none_keeps_the_guard_over_the_attempts_own_socket(dsn, sidecars):
    """Issue 41 point 1: NETWORK=none took the guard away (no URL, no secret), so the
    strictest sandbox had no fenced checkpoints, no progress over HTTP and nothing to ask
    before an irreversible step. Now each attempt gets its own Unix socket in its work
    directory (bound into the sandbox with it, SIDECAR_GUARD_SOCKET) and its secret: a go,
    a fenced checkpoint and a progress report all work through it with no network. Another
    running attempt's socket is not even visible from inside a sandbox."""
    env = _env(dsn, SIDECAR_NETWORK="none", SIDECAR_LEASE_SECONDS="6",
               SIDECAR_STAGE_TIMEOUT_SECONDS="60")
    sidecars(dsn, TOOL, "--tool", "sbx", "--concurrency", "2", env=env)
    first = enqueue(dsn, "sbx", {"mode": "guard_socket", "hold": 60})
    # The first attempt reports its socket's path as its progress, through that socket.
    wait_until(lambda: (job_row(dsn, first)["progress"] or {}).get("message"), 30,
               what="the first attempt's progress through its socket")
    socket_path = job_row(dsn, first)["progress"]["message"]
    assert socket_path.endswith("/guard.sock") and os.path.exists(socket_path)
    second = enqueue(dsn, "sbx", {"mode": "guard_socket", "other_socket": socket_path})
    row = _ended(dsn, second)
    Path(socket_path).with_name("release").touch()
    assert row["state"] == "succeeded", row["error"]
    seen = row["result"]
    assert seen["guard_url"] is None and seen["token"] is True, seen
    assert seen["socket"].endswith("/guard.sock") and seen["socket"] != socket_path
    status, answer = seen["guard"]
    assert (status, answer["fencing_token"]) == (200, 1), seen
    assert seen["checkpoint"][0] == 200 and seen["checkpoint"][1]["saved"] is True, seen
    assert seen["progress"][0] in (200, 202), seen
    assert seen["other"] == "FileNotFoundError", seen  # hidden: the work root is a tmpfs
    assert job_row(dsn, second)["checkpoint"] == {"through": "socket"}
    assert job_row(dsn, second)["progress"]["message"] == seen["socket"]
    first_row = _ended(dsn, first)
    assert first_row["state"] == "succeeded", first_row["error"]
    assert first_row["result"]["guard"][0] == 200
    assert not os.path.exists(socket_path)  # its name goes with the attempt


def test_a_sandbox_that_cannot_start_fails_sandbox_failed(dsn, sidecars, tmp_path):
    """An EXTRA_PATHS directory removed after the start: bwrap cannot bind it and exits
    before the tool runs. That is ``sandbox_failed`` with bwrap's line, not the tool's
    exit status 1."""
    extra = tmp_path / "extra"
    extra.mkdir()
    sc = sidecars(dsn, TOOL, "--tool", "sbx", env=_env(dsn, SIDECAR_EXTRA_PATHS=str(extra)))
    sc.wait_event("worker_started", 30)
    extra.rmdir()
    job = enqueue(dsn, "sbx", {"mode": "exit", "code": 0})
    error = _ended(dsn, job)["error"]
    assert error["kind"] == "sandbox_failed", error
    assert "bwrap" in error["message"], error


def test_a_secrets_directory_replaced_while_an_attempt_waits_stays_hidden(
        dsn, sidecars, public_dir):
    """A launcher prepared ahead (docs/isolation.md, "Prepared attempts") set its sandbox
    up while the secrets' directory was the old one: bwrap's tmpfs hides that directory
    object. The host then rotates it (the old one renamed away, a new one in its place),
    which since Linux 3.18 leaves the waiting sandbox showing the new one. The job
    started next must still find no secret there: the waiting launcher is not used (its
    mounts moved), and the replacement prepared after the rotation hides the new one."""
    base = public_dir(0o700, 0, "/var/tmp")
    secrets = base / "s"
    secrets.mkdir()
    secret = secrets / "url"
    secret.write_text(dsn + "\n")
    env = _env(dsn, SIDECAR_DATABASE_URL_FILE=str(secret), SIDECAR_LOG_LEVEL="debug")
    del env["SIDECAR_DATABASE_URL"]
    sc = sidecars(dsn, TOOL, "--tool", "sbx", env=env)
    sc.wait_event("attempt_prepared", 30)
    secrets.rename(base / "s.old")
    secrets.mkdir()
    secret.write_text(dsn + "\n")
    for _ in range(2):
        job = enqueue(dsn, "sbx", {"mode": "read", "path": str(secret)})
        row = _ended(dsn, job)
        assert row["state"] == "failed" and row["result"] is None, row
        assert "cannot read" in row["error"]["message"] + str(row["error"]), row["error"]


def test_config_shows_the_sandbox_and_refuses_a_bad_extra_path(dsn, tmp_path):
    """`sidecar config` runs the start-up probe: the default profile's sandbox is on here;
    an EXTRA_PATHS entry that does not exist is one line and exit 2."""
    env = base_env(dsn)
    del env["SIDECAR_SANDBOX"]
    done = cli(dsn, "config", env=env)
    assert done.returncode == 0, done.stderr.decode()
    assert orjson.loads(done.stdout)["defaults"]["sandbox"] == {"mode": "auto",
                                                                 "active": True}
    env["SIDECAR_EXTRA_PATHS"] = str(tmp_path / "missing") + ":rw"
    done = cli(dsn, "config", env=env)
    assert done.returncode == 2
    assert "SIDECAR_EXTRA_PATHS" in done.stderr.decode()


def test_a_command_the_sandbox_would_hide_is_refused_at_start_even_through_a_link(
        dsn, tmp_path):
    """bwrap executes the command's path as given: a link under /tmp (a venv's
    bin/python in a checkout under /tmp) to a program outside it vanished inside the
    sandbox, and every attempt failed `sandbox_failed` until the job's attempts were gone.
    `sidecar run` checks the path as given and the file it links to, and refuses at start:
    exit 2, one line naming SANDBOX."""
    link = Path(tempfile.mkdtemp(prefix="sidecar-link-", dir="/tmp")) / "python"
    try:
        link.symlink_to(os.path.realpath(sys.executable))
        done = cli(dsn, "run", "--tool", "sbx", "--drain", "--", str(link), "-c", "pass",
                   env=base_env(dsn, SIDECAR_SANDBOX="required"))
        assert done.returncode == 2, done.stderr.decode()
        err = done.stderr.decode().strip()
        assert "\n" not in err and "SANDBOX" in err and str(link) in err, err
    finally:
        shutil.rmtree(link.parent, ignore_errors=True)


def test_the_start_says_what_tools_cannot_see_and_a_failed_job_says_why(dsn, sidecars,
                                                                        tmp_path):
    """Issue 41, point 8: five OCR jobs on images in the system temporary directory failed
    with the tool's own status and nothing said why. `sidecar run` logs once at start the
    host paths its tools cannot see and how to bind inputs (EXTRA_PATHS); a job whose
    payload names such a path and fails carries a hint saying so (row and journal), and
    the same input bound with EXTRA_PATHS is read."""
    image = tmp_path / "inputs" / "scan.png"
    image.parent.mkdir()
    image.write_bytes(b"\x89PNG" + bytes(100))
    sc = sidecars(dsn, TOOL, "--tool", "ocr", env=_env(dsn))
    said = sc.wait_event("sandbox_hides")
    assert said["tool"] == "ocr" and "/tmp" in said["hidden"], said
    assert "EXTRA_PATHS" in said["hint"], said
    job = enqueue(dsn, "ocr", {"mode": "read", "path": str(image)})
    row = _ended(dsn, job)
    assert row["state"] == "failed" and row["error"]["exit_code"] == 2, row["error"]
    assert str(image) in row["error"]["hint"] and "EXTRA_PATHS" in row["error"]["hint"]
    [failed] = journal_details(dsn, job, "job_failed")
    assert failed["hidden_paths"] == [str(image)]
    assert len(sc.events("sandbox_hides")) == 1  # once, at start

    bound = sidecars(dsn, TOOL, "--tool", "ocr-bound",
                     env=_env(dsn, SIDECAR_EXTRA_PATHS=f"{image.parent}:ro"))
    # (a checkout under /tmp has its own directory bound back too: the tools live there)
    assert f"{image.parent}:ro" in bound.wait_event("sandbox_hides")["bound"]
    job = enqueue(dsn, "ocr-bound", {"mode": "read", "path": str(image)})
    row = _ended(dsn, job)
    assert row["state"] == "succeeded" and row["result"] == {"bytes": 104}, row
