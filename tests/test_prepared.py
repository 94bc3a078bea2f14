"""Attempts prepared ahead of their jobs (issue 42, sidecar.worker.prepared): the job's
line and its refusals (unit), a real launcher under /bin/sh (e2e), and a real sidecar
whose attempts run in launchers set up before their jobs were claimed (e2e)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kit import base_env, enqueue, job_row, journal_details, wait_until
from sidecar.worker.prepared import FIELD_SEPARATOR, READY, job_line, launcher_argv

# The tool: its environment as JSON, a line, then its whole stdin (not a shell: a shell
# would export a PWD of its own).
SHOW = [sys.executable, "-c", "import json, os, sys; sys.stdout.buffer.write("
        "json.dumps(dict(os.environ)).encode() + b'\\n---\\n' + sys.stdin.buffer.read())"]


@pytest.mark.unit
def test_the_job_line_carries_names_and_values_or_refuses_the_attempt():
    line = job_line({"SIDECAR_JOB_ID": "42", "TRACESTATE": "a=b, c=d e"})
    assert line == f"SIDECAR_JOB_ID=42{FIELD_SEPARATOR}TRACESTATE=a=b, c=d e\n".encode()
    assert job_line({}) == b"\n"
    for bad in ({"X": "two\nlines"}, {"X": "a" + FIELD_SEPARATOR + "b"}, {"X": "nul\0"},
                {"1X": "v"}, {"X-Y": "v"}, {"": "v"}, {"X=Y": "v"}, {"IFS": "v"},
                {"PPID": "1"}, {"SIDECAR_LAUNCHER_LINE": "v"}):
        assert job_line(bad) is None, bad


@pytest.mark.unit
def test_the_launcher_joins_its_cgroup_before_the_sandbox_and_reads_inside_it():
    wrap = lambda inner: ["/usr/bin/bwrap", "--", *inner]  # noqa: E731
    argv = launcher_argv(["/bin/tool", "a b"], ["/cg/cgroup.procs"], wrap, False)
    assert argv[:2] == ["/bin/sh", "-c"] and "cgroup.procs" not in argv[2]
    assert argv[4:7] == ["/cg/cgroup.procs", "--", "/usr/bin/bwrap"]
    assert argv[-2:] == ["/bin/tool", "a b"] and "read -r" in argv[-4]
    assert launcher_argv(["/bin/tool"], [], None, True)[2].count("unset PWD") == 1


def _launch(argv, env):
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd="/")


@pytest.mark.e2e
def test_a_launcher_runs_its_tool_with_the_lines_variables_and_the_payload_intact():
    """The values reach the tool as written (no shell expansion of $, `, *, quotes or
    spaces), the payload after the line is the tool's whole stdin, byte for byte, and
    an unsandboxed launcher leaves no PWD of its own."""
    values = {"SIDECAR_JOB_ID": "01a2-x", "ODD": "$HOME `id` * 'q' \"d\" \\ a=b  ",
              "EMPTY": ""}
    payload = b'{"k": "line1\\nline2"}\n\x00\xff tail'
    proc = _launch(launcher_argv(SHOW, [], None, True), {"PATH": "/usr/bin:/bin", "KEEP": "1"})
    out, err = proc.communicate(job_line(values) + payload, timeout=10)
    assert proc.returncode == 0, err
    assert out.startswith(READY)  # said before the line was read, then the tool's own
    env_text, _, stdin = out[len(READY):].partition(b"---\n")
    seen = json.loads(env_text)
    assert {k: seen.get(k) for k in values} == values
    assert seen["KEEP"] == "1" and "PWD" not in seen and "line" not in seen
    assert stdin == payload


@pytest.mark.e2e
def test_a_launcher_without_its_line_starts_nothing():
    proc = _launch(launcher_argv(SHOW, [], None, True), {"PATH": "/usr/bin:/bin"})
    out, _ = proc.communicate(b"", timeout=10)
    assert proc.returncode == 125 and out == READY


@pytest.mark.e2e
def test_a_sidecars_attempts_run_in_launchers_prepared_before_their_jobs(dsn, sidecars):
    """Each job claimed while an attempt is ready runs in it (its cgroup, where there is
    one, is a prepared one: job-p<n>-0) with its own job's variables, and another is
    prepared for the next; with SIDECAR_PREPARE false the same jobs start cold."""
    script = 'printf \'{"job": "%s", "token": "%s"}\' "$SIDECAR_JOB_ID" "$SIDECAR_FENCING_TOKEN"'
    for prepare in ("true", "false"):
        tool = f"prep-{prepare}"
        sc = sidecars(dsn, ["/bin/sh", "-c", script], "--tool", tool,
                      env=base_env(dsn, SIDECAR_PREPARE=prepare, SIDECAR_LOG_LEVEL="debug"))
        sc.wait_event("worker_started")
        for n in range(3):
            if prepare == "true":  # the attempt for this job is ready before it exists
                wait_until(lambda n=n, sc=sc: len(sc.events("attempt_prepared")) > n, 15,
                           what="an attempt prepared ahead")
            job = enqueue(dsn, tool, {"n": n})
            wait_until(lambda job=job: job_row(dsn, job)["state"] not in ("queued", "running"),
                       20, what="the job's end")
            row = job_row(dsn, job)
            assert row["state"] == "succeeded", row["error"]
            assert row["result"]["job"] == job and row["result"]["token"] == "1"
            [started] = journal_details(dsn, job, "tool_request_started")
            if os.geteuid() == 0:  # job cgroups
                assert (".job-p" in started["cgroup"]) == (prepare == "true"), started
        sc.stop()
        assert sc.events("attempt_prepared") == [] or prepare == "true"


@pytest.mark.e2e
@pytest.mark.parametrize("prepare", ["true", "false"])
@pytest.mark.parametrize("replacement, exit_code", [
    ("touch {marker}; echo '{{}}'\n", 126),  # no #!: ENOEXEC, never run by a shell
    ("#!/nonexistent/interpreter\ntouch {marker}\n", 127),  # its interpreter is gone
    ("#!/bin/sh\r\ntouch {marker}\n", 127),  # CRLF: the interpreter is "/bin/sh\r"
    (None, 127),  # an ELF program whose dynamic loader (PT_INTERP) is missing
], ids=["no-shebang", "missing-interpreter", "crlf", "missing-loader"])
def test_a_tool_replaced_by_one_the_kernel_cannot_run_fails_spawn_failed_either_way(
        dsn, sidecars, tmp_path, prepare, replacement, exit_code):
    """The tool's file is replaced under a running sidecar (an image upgrade gone wrong)
    by one execve refuses. A cold start says spawn_failed (126 or 127) and runs nothing.
    A prepared launcher must not differ: /bin/sh's ``exec`` runs a file without ``#!`` as
    a shell script of its own (so a file never meant to run, did) and reports a missing
    interpreter as the tool's own exit status 127."""
    tool = tmp_path / "replaced-tool"
    marker = tmp_path / "it-ran"
    tool.write_text("#!/bin/sh\necho '{}'\n")
    tool.chmod(0o755)
    sc = sidecars(dsn, [str(tool)], "--tool", "replaced",
                  env=base_env(dsn, SIDECAR_PREPARE=prepare, SIDECAR_LOG_LEVEL="debug"))
    sc.wait_event("worker_started")
    if prepare == "true":
        wait_until(lambda: sc.events("attempt_prepared"), 15, what="an attempt prepared")
    fresh = tmp_path / "fresh"
    if replacement is None:  # /bin/true asking for a loader that is not there
        binary = Path("/bin/true").read_bytes()
        loader = re.search(rb"/lib[^\0]*/ld-[^\0]+", binary).group()
        fresh.write_bytes(binary.replace(loader, loader[:-1] + b"X", 1))
    else:
        fresh.write_text(replacement.format(marker=marker))
    fresh.chmod(0o755)
    os.replace(fresh, tool)
    # The first job meets the launcher prepared for the old file, the second one a
    # launcher prepared (or not) for the new one.
    for _ in range(2):
        job = enqueue(dsn, "replaced", {}, "--max-attempts", "1")
        wait_until(lambda job=job: job_row(dsn, job)["state"] not in ("queued", "running"),
                   20, what="the job's end")
        row = job_row(dsn, job)
        assert not marker.exists(), "the replaced tool's text was run by a shell"
        assert (row["state"], row["error"]["kind"], row["error"].get("exit_code")) == \
            ("failed", "spawn_failed", exit_code), row["error"]


# Variable names the launcher's shell sets itself (its own, or POSIX sh's: dash resets an
# imported IFS, OPTIND and PPID, and a PWD that does not name its directory).
SHELL_NAMES = {"line": "L", "kv": "K", "IFS": "x", "OPTIND": "7", "PPID": "5",
               "PWD": "/nowhere"}


@pytest.mark.e2e
@pytest.mark.parametrize("prepare", ["true", "false"])
def test_variables_the_launchers_shell_owns_reach_the_tool_as_passed(dsn, sidecars, prepare):
    """ENV_PASSTHROUGH may name any variable; the tool gets the sidecar's value, as a cold
    start gives it. A launcher must not lose or rewrite one because its shell uses the
    same name (its loop variables, or what POSIX sh sets at start)."""
    show = [sys.executable, "-c", "import json, os; print(json.dumps("
            f"{{k: os.environ.get(k) for k in {sorted(SHELL_NAMES)!r}}}))"]
    env = base_env(dsn, SIDECAR_PREPARE=prepare, SIDECAR_LOG_LEVEL="debug",
                   SIDECAR_ENV_PASSTHROUGH="PATH," + ",".join(SHELL_NAMES), **SHELL_NAMES)
    sc = sidecars(dsn, show, "--tool", "shellnames", env=env)
    sc.wait_event("worker_started")
    job = enqueue(dsn, "shellnames", {})
    wait_until(lambda: job_row(dsn, job)["state"] not in ("queued", "running"), 20,
               what="the job's end")
    row = job_row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == SHELL_NAMES


@pytest.mark.unit
def test_exec_files_prepares_only_what_execve_would_start(tmp_path):
    """exec_files (the check before a launcher is prepared) follows execve: ELF of this
    machine with its loader, and #! lines read as Linux reads them; everything else
    raises, and those attempts start cold."""
    from sidecar.worker.prepared import exec_files

    def tool(name: str, content: bytes) -> str:
        path = tmp_path / name
        path.write_bytes(content)
        path.chmod(0o755)
        return str(path)

    true = Path("/bin/true").read_bytes()
    loader = re.search(rb"/lib[^\0]*/ld-[^\0]+", true).group()
    assert [p for p, _ in exec_files("/bin/true")][0] == "/bin/true"
    assert len(exec_files("/bin/true")) == 2  # and its dynamic loader
    script = tool("ok", b"#!/bin/sh -e\necho\n")
    assert [p for p, _ in exec_files(script)][:2] == [script, "/bin/sh"]
    assert exec_files(tool("short", b"#!/bin/sh"))  # no newline in a short file: runs
    foreign = bytearray(true)
    foreign[18:20] = b"\xb7\x00" if foreign[18:20] != b"\xb7\x00" else b"\x3e\x00"
    for name, content in (("plain", b"echo hi\n"), ("crlf", b"#!/bin/sh\r\necho\n"),
                          ("relative", b"#!sh\n"), ("gone", b"#!/nonexistent/sh\n"),
                          ("cut", b"#!/" + b"x" * 300 + b"\n"),
                          ("foreign", bytes(foreign)),
                          ("noloader", true.replace(loader, loader[:-1] + b"X", 1))):
        with pytest.raises(OSError):
            exec_files(tool(name, content))
    with pytest.raises(OSError):
        exec_files(str(tmp_path))  # a directory
    (tmp_path / "noexec").write_bytes(b"#!/bin/sh\n")  # mode 0644: no x bit, even for root
    with pytest.raises(OSError):
        exec_files(str(tmp_path / "noexec"))
