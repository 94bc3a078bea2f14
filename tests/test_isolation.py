"""Isolation of the child and hostile input (docs/isolation.md): each limit
proved with a real misbehaving tool (tests/tools/hostile.py) run by a real `sidecar run`,
in both isolation modes: per-job cgroups (the default as root where the host has them) and
rlimits (SIDECAR_CGROUPS=off). Also the work directory, the environment allow-list, the
inherited file descriptors, RUN_AS, the result file and bad tool output."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import pytest

from kit import (
    TOOLS,
    base_env,
    cli,
    enqueue,
    job_processes,
    query,
    short_root,
)
from kit import (
    job_row as _row,
)
from kit import (
    journal_details as _journal,
)
from sidecar.protocol.errors import ConfigError
from sidecar.runtime.config import load_settings
from sidecar.worker.cgroups import detect
from sidecar.worker.isolation import check_profile, remove_tree

HOSTILE = str(TOOLS / "hostile.py")
MIB = 1024 * 1024
ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="per-job cgroups and RUN_AS need root")






def _env(dsn, tmp_path, **extra):
    work = tmp_path / "work"
    return base_env(dsn, SIDECAR_WORK_DIR=str(short_root(work)),
                    SIDECAR_STAGE_TIMEOUT_SECONDS="20",
                    **extra), work


def _drain(dsn, env, tool, command=(HOSTILE,), timeout=90):
    done = cli(dsn, "run", "--tool", tool, "--drain", "--", *command, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done


def _assert_work_dir_empty(work: Path) -> None:
    assert work.is_dir() and list(work.iterdir()) == [], list(work.iterdir())


@pytest.fixture
def cgroup_host():
    host = detect()
    assert host.memory and host.pids, (
        f"this host gives root no memory/pids cgroup to test with: {host.notes}")
    return host


# --- memory -------------------------------------------------------------------------------

@pytest.mark.e2e
@needs_root
def test_memory_hog_is_killed_in_its_cgroup_and_fails_as_memory_limit(dsn, tmp_path,
                                                                        cgroup_host):
    env, work = _env(dsn, tmp_path, SIDECAR_PROFILE_HOG_MEMORY_BYTES=str(64 * MIB))
    job = enqueue(dsn, "hog", {"mode": "memory_hog"}, "--max-attempts", "1", env=env)
    _drain(dsn, env, "hog")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "memory_limit", row["error"]
    assert "OOM" in row["error"]["message"]
    [summary] = _journal(dsn, job, "job_failed")
    assert summary["kind"] == "memory_limit" and summary["oom_kills"] >= 1
    # Peak memory of the tree, as the cgroup measured it: near the limit, never far above.
    assert 32 * MIB < summary["peak_memory_bytes"] <= 64 * MIB + MIB
    assert job_processes(job) == []
    _assert_work_dir_empty(work)


@pytest.mark.e2e
def test_memory_hog_under_rlimits_fails_as_memory_limit(dsn, tmp_path):
    env, work = _env(dsn, tmp_path, SIDECAR_CGROUPS="off",
                     SIDECAR_PROFILE_HOG_MEMORY_BYTES=str(256 * MIB))
    job = enqueue(dsn, "hog", {"mode": "memory_hog"}, "--max-attempts", "1", env=env)
    _drain(dsn, env, "hog")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "memory_limit", row["error"]
    assert "RLIMIT_AS" in row["error"]["message"]
    [summary] = _journal(dsn, job, "job_failed")
    assert summary["peak_memory_bytes"] <= 256 * MIB  # the child's own rusage
    _assert_work_dir_empty(work)


# --- processes ----------------------------------------------------------------------------

@pytest.mark.e2e
@needs_root
def test_fork_bomb_is_capped_by_processes_and_fails_as_process_limit(dsn, tmp_path,
                                                                     cgroup_host):
    env, work = _env(dsn, tmp_path, SIDECAR_PROFILE_BOMB_PROCESSES="16")
    job = enqueue(dsn, "bomb", {"mode": "fork_bomb"}, "--max-attempts", "1", env=env)
    _drain(dsn, env, "bomb")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "process_limit", row["error"]
    [killed] = _journal(dsn, job, "child_killed")  # the bomb's remains, killed as a tree
    assert 1 <= killed["killed"] <= 16 and killed["survivors"] == 0
    [summary] = _journal(dsn, job, "job_failed")
    assert summary["process_limit_hits"] >= 1
    assert job_processes(job) == []
    _assert_work_dir_empty(work)


@pytest.mark.e2e
def test_processes_without_a_cgroup_or_run_as_is_refused_at_start(dsn, tmp_path):
    env, _ = _env(dsn, tmp_path, SIDECAR_CGROUPS="off", SIDECAR_PROFILE_BOMB_PROCESSES="8")
    done = cli(dsn, "run", "--tool", "bomb", "--drain", "--", HOSTILE, env=env)
    assert done.returncode == 2
    message = done.stderr.decode()
    assert "SIDECAR_PROFILE_BOMB_PROCESSES=8" in message and "RUN_AS" in message
    assert "Traceback" not in message


@pytest.fixture
def public_work():
    """A work root every user can reach (pytest's tmp_path sits under a 0700 directory,
    which RUN_AS users cannot enter: `sidecar run` refuses that at start)."""
    where = Path(tempfile.mkdtemp(prefix="sidecar-work-"))
    where.chmod(0o755)
    yield where / "work"
    shutil.rmtree(where)


def _world_readable_tool() -> str:
    """hostile.py where another user can read it (the checkout may sit under /root)."""
    where = tempfile.mkdtemp(prefix="sidecar-tool-")
    os.chmod(where, 0o755)
    path = os.path.join(where, "hostile.py")
    shutil.copy(HOSTILE, path)
    os.chmod(path, 0o755)
    return path


@pytest.mark.e2e
@needs_root
def test_fork_bomb_under_rlimits_is_capped_by_run_as_and_nproc(dsn, public_work):
    tool = _world_readable_tool()
    try:
        env, work = _env(dsn, public_work.parent, SIDECAR_CGROUPS="off",
                         SIDECAR_PROFILE_BOMB_PROCESSES="8",
                         SIDECAR_PROFILE_BOMB_RUN_AS="65534:65534")
        job = enqueue(dsn, "bomb", {"mode": "fork_bomb"}, "--max-attempts", "1", env=env)
        _drain(dsn, env, "bomb", command=("/usr/bin/python3", tool))
        row = _row(dsn, job)
        assert row["state"] == "failed" and row["error"]["exit_code"] == 3, row["error"]
        [killed] = _journal(dsn, job, "child_killed")
        assert 1 <= killed["killed"] <= 8 and killed["survivors"] == 0
        assert job_processes(job) == []
        _assert_work_dir_empty(work)
    finally:
        shutil.rmtree(os.path.dirname(tool))


# --- CPU ----------------------------------------------------------------------------------

@pytest.mark.e2e
@needs_root
def test_cpu_spinners_are_stopped_at_the_trees_cpu_seconds(dsn, tmp_path, cgroup_host):
    env, work = _env(dsn, tmp_path, SIDECAR_PROFILE_SPIN_CPU_SECONDS="1.5")
    job = enqueue(dsn, "spin", {"mode": "cpu_spin", "procs": 2}, "--max-attempts", "1",
                  env=env)
    _drain(dsn, env, "spin")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "cpu_limit", row["error"]
    assert row["error"]["cpu_seconds"] >= 1.5
    # Two spinners: the tree's sum hit the limit, long before either reached it alone.
    [summary] = _journal(dsn, job, "job_failed")
    assert 1.5 <= summary["cpu_seconds"] < 6
    assert job_processes(job) == []
    _assert_work_dir_empty(work)


@pytest.mark.e2e
def test_cpu_spinner_under_rlimits_fails_as_cpu_limit(dsn, tmp_path):
    env, work = _env(dsn, tmp_path, SIDECAR_CGROUPS="off", SIDECAR_PROFILE_SPIN_CPU_SECONDS="1")
    job = enqueue(dsn, "spin", {"mode": "cpu_spin"}, "--max-attempts", "1", env=env)
    _drain(dsn, env, "spin")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "cpu_limit", row["error"]
    assert job_processes(job) == []
    _assert_work_dir_empty(work)


# --- open files ---------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("cgroups", ["auto", "off"])
def test_fd_leaker_is_capped_by_open_files(dsn, tmp_path, cgroups):
    env, work = _env(dsn, tmp_path, SIDECAR_CGROUPS=cgroups,
                     SIDECAR_PROFILE_LEAK_OPEN_FILES="32")
    job = enqueue(dsn, "leak", {"mode": "fd_leak"}, env=env)
    _drain(dsn, env, "leak")
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"]["errno"] == 24  # EMFILE
    assert 20 <= row["result"]["opened"] <= 32 - 3  # stdin, stdout, stderr count too
    _assert_work_dir_empty(work)


# --- what the child sees ------------------------------------------------------------------

@pytest.mark.e2e
def test_child_sees_stdio_only_an_allow_listed_environment_and_its_own_dir(dsn, tmp_path):
    env, work = _env(dsn, tmp_path, SIDECAR_PROFILE_LOOK_ENV_PASSTHROUGH="PATH,ALLOWED_VAR",
                     ALLOWED_VAR="yes", SECRET_TOKEN="must-not-pass",
                     AWS_SECRET_ACCESS_KEY="must-not-pass-either")
    job = enqueue(dsn, "look", {"mode": "inspect"}, env=env)
    # The interpreter itself, not a version manager's shim that adds variables of its own.
    _drain(dsn, env, "look", command=(sys.executable, HOSTILE))
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    seen = row["result"]
    assert seen["fds"] == [0, 1, 2]
    names = set(seen["env"]) - {"LC_CTYPE"}  # set by Python itself in a C locale (PEP 538)
    assert {"PATH", "ALLOWED_VAR"} <= names
    assert "SECRET_TOKEN" not in names and "AWS_SECRET_ACCESS_KEY" not in names
    assert "SIDECAR_DATABASE_URL" not in names
    assert not any("must-not-pass" in value for value in seen["env"].values())
    outside = {n for n in names if not n.startswith("SIDECAR_")}
    assert outside == {"PATH", "ALLOWED_VAR", "TMPDIR", "TMP", "TEMP", "HOME",
                       "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_RUNTIME_DIR"}
    job_dir = seen["env"]["SIDECAR_JOB_DIR"]
    assert Path(job_dir).parent.resolve() == work.resolve()
    assert seen["cwd"] == os.path.realpath(job_dir) and seen["tmp"] == job_dir
    # HOME and the XDG base directories are the attempt's own (profile HOME=job).
    assert seen["env"]["HOME"] == os.path.join(job_dir, "h")
    assert seen["env"]["XDG_RUNTIME_DIR"] == os.path.join(job_dir, "r")
    assert all(seen["env"][f"XDG_{name}_HOME"].startswith(job_dir + "/h/")
               for name in ("CONFIG", "CACHE", "DATA"))
    assert seen["env"]["SIDECAR_RESULT_FILE"] == os.path.join(job_dir, "result.json")
    assert seen["env"]["SIDECAR_GUARD_SOCKET"] == os.path.join(job_dir, "guard.sock")
    assert seen["guard_socket"] == {"uid": os.geteuid(), "mode": "0o600", "connect": "ok"}
    assert seen["core"] == [0, 0]  # no core dumps unless the profile asks for them
    assert not os.path.exists(job_dir)
    [summary] = _journal(dsn, job, "job_succeeded")
    assert summary["cpu_seconds"] >= 0 and summary["peak_memory_bytes"] > MIB
    if ROOT:  # each attempt in a cgroup of its own, named in its journal
        [started] = _journal(dsn, job, "tool_request_started")
        assert "sidecar-jobs/" + started["cgroup"] in seen["cgroup"]


@pytest.mark.e2e
def test_core_dumps_can_be_allowed_per_profile(dsn, tmp_path):
    env, _ = _env(dsn, tmp_path, SIDECAR_PROFILE_LOOK_CORE_DUMPS="true")
    job = enqueue(dsn, "look", {"mode": "inspect"}, env=env)
    _drain(dsn, env, "look")
    import resource

    assert _row(dsn, job)["result"]["core"] == list(resource.getrlimit(resource.RLIMIT_CORE))


@pytest.mark.e2e
def test_work_dir_is_removed_with_whatever_the_tool_left_in_it(dsn, tmp_path):
    env, work = _env(dsn, tmp_path)
    job = enqueue(dsn, "litter", {"mode": "litter"}, env=env)
    _drain(dsn, env, "litter")
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"]["tmp_file"].startswith(row["result"]["job_dir"] + os.sep)
    assert not os.path.exists(row["result"]["job_dir"])
    _assert_work_dir_empty(work)


@pytest.mark.unit
def test_work_dir_removal_never_follows_a_symlink_out_of_it(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the tool's")
    outside.chmod(0o755)
    job_dir = tmp_path / "job"
    (job_dir / "sub").mkdir(parents=True)
    (job_dir / "sub" / "link").symlink_to(outside)
    (job_dir / "file-link").symlink_to(outside / "keep.txt")
    (job_dir / "locked" / "inner").mkdir(parents=True)
    (job_dir / "locked" / "inner" / "f").write_text("x")
    (job_dir / "locked").chmod(0o500)
    remove_tree(str(job_dir))
    assert not os.path.lexists(job_dir)
    assert (outside / "keep.txt").read_text() == "not the tool's"
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755  # never chmod-ed through a link

    # The tool replaced its work directory by a link to another directory: the link goes,
    # the directory it points at stays as it was.
    job_dir.symlink_to(outside)
    remove_tree(str(job_dir))
    assert not os.path.lexists(job_dir) and (outside / "keep.txt").exists()


@pytest.mark.e2e
@needs_root
def test_run_as_starts_the_tool_as_that_user_in_a_dir_it_owns(dsn, public_work):
    tool = _world_readable_tool()
    try:
        env, work = _env(dsn, public_work.parent, SIDECAR_PROFILE_LOOK_RUN_AS="65534:65534")
        job = enqueue(dsn, "look", {"mode": "inspect"}, env=env)
        _drain(dsn, env, "look", command=("/usr/bin/python3", tool))
        row = _row(dsn, job)
        assert row["state"] == "succeeded", row["error"]
        seen = row["result"]
        assert (seen["uid"], seen["gid"], seen["groups"]) == (65534, 65534, [])
        assert seen["fds"] == [0, 1, 2]
        # Its guard socket (issue 41) is its own user's, mode 0600, and answers it.
        assert seen["guard_socket"] == {"uid": 65534, "mode": "0o600", "connect": "ok"}
        _assert_work_dir_empty(work)
    finally:
        shutil.rmtree(os.path.dirname(tool))


@pytest.mark.unit
def test_run_as_is_refused_when_the_sidecar_is_not_root():
    settings = load_settings({"SIDECAR_PROFILE_LOOK_RUN_AS": "65534"})
    with pytest.raises(ConfigError, match="SIDECAR_PROFILE_LOOK_RUN_AS=65534: the sidecar must"):
        check_profile(settings.profile("look"), detect("off"), euid=1000)


@pytest.mark.e2e
def test_config_says_which_isolation_mode_is_active(dsn):
    shown = orjson.loads(cli(dsn, "config", env=base_env(dsn, SIDECAR_CGROUPS="off")).stdout)
    assert shown["isolation"]["mode"] == "rlimit"
    assert shown["isolation"]["tree_kill"] == "psutil tree scan"
    refused = orjson.loads(cli(dsn, "config", env=base_env(
        dsn, SIDECAR_CGROUPS="off", SIDECAR_PROFILE_BOMB_PROCESSES="8")).stdout)
    [bomb] = refused["profiles"]
    assert "RUN_AS" in bomb["isolation_error"]
    if ROOT:
        auto = orjson.loads(cli(dsn, "config", env=base_env(dsn)).stdout)["isolation"]
        assert auto["mode"] == "cgroup" and auto["cgroup_dirs"]


# --- results ------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_large_result_file_is_the_result_and_stdout_is_ignored(dsn, tmp_path):
    env, work = _env(dsn, tmp_path, SIDECAR_PROFILE_BIG_MAX_RESULT_BYTES=str(4 * MIB))
    ok = enqueue(dsn, "big", {"mode": "result_file", "size": 3 * MIB}, env=env)
    too_big = enqueue(dsn, "big", {"mode": "result_file", "size": 5 * MIB}, env=env)
    _drain(dsn, env, "big")
    row = _row(dsn, ok)
    assert row["state"] == "succeeded", row["error"]
    assert row["result"] == {"blob": "r" * (3 * MIB)}
    bad = _row(dsn, too_big)  # the same kind as too much on stdout
    assert bad["state"] == "failed" and bad["error"]["kind"] == "result_too_large"
    assert "SIDECAR_PROFILE_BIG_MAX_RESULT_BYTES" in bad["error"]["message"]
    _assert_work_dir_empty(work)


@pytest.mark.e2e
def test_a_result_file_that_is_a_symlink_is_refused(dsn, tmp_path):
    secret = tmp_path / "root-only.json"
    secret.write_text('{"secret": "of the sidecar"}')
    secret.chmod(stat.S_IRUSR)
    env, _ = _env(dsn, tmp_path)
    job = enqueue(dsn, "sneak", {"mode": "result_symlink", "target": str(secret)}, env=env)
    _drain(dsn, env, "sneak")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "bad_result"
    assert row["result"] is None and "of the sidecar" not in orjson.dumps(row["error"]).decode()


def _hex(text: str) -> str:
    """Bytes for the emit mode: each character of ``text`` as one byte (latin-1), in hex."""
    return text.encode("latin-1").hex()


@pytest.mark.e2e
def test_a_result_file_that_is_a_hard_link_is_refused_and_its_target_left_alone(dsn, tmp_path):
    target = tmp_path / "someone-elses.json"
    target.write_text('{"private": true}')
    target.chmod(0o644)
    before = target.stat()
    env, work = _env(dsn, tmp_path)  # the work dir is on the same filesystem as the target
    job = enqueue(dsn, "sneak", {"mode": "result_hardlink", "target": str(target)}, env=env)
    _drain(dsn, env, "sneak")
    row = _row(dsn, job)
    assert row["state"] == "failed" and row["error"]["kind"] == "bad_result"
    assert "hard link" in row["error"]["message"]
    after = target.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (
        before.st_mode, before.st_uid, before.st_gid)
    assert target.read_text() == '{"private": true}'
    _assert_work_dir_empty(work)


BAD_OUTPUTS = {
    "not_utf8": "\xff\xfe{}",
    "raw_nul": '{"a": "x\x00y"}',
    "nul_escape": '{"a": "x\\u0000y"}',
    "deep": "[" * 10_000 + "]" * 10_000,
    # 1e400 and a 400-digit integer are stored exactly (case F24); these two are beyond
    # what PostgreSQL's numeric holds.
    "huge_float": '{"n": 1e131072}',
    "tiny_float": '{"n": 1e-16384}',
    "not_json": "hello",
}


@pytest.mark.e2e
def test_bad_tool_output_fails_as_bad_result_and_never_stops_the_sidecar(dsn, tmp_path):
    env, work = _env(dsn, tmp_path)
    jobs = {name: enqueue(dsn, "emit", {"mode": "emit", "stdout": _hex(text)}, env=env)
            for name, text in BAD_OUTPUTS.items()}
    big_int = "9" * 30
    exact = enqueue(dsn, "emit", {"mode": "emit", "stdout": _hex('{"n": ' + big_int + "}")},
                    env=env)
    nul_stderr = enqueue(dsn, "emit", {"mode": "emit", "stderr": _hex("bad\x00\x1b[2J\xff tail"),
                                       "code": 1}, "--max-attempts", "1", env=env)
    _drain(dsn, env, "emit")
    for name, job in jobs.items():
        row = _row(dsn, job)
        assert (row["state"], row["error"]["kind"]) == ("failed", "bad_result"), name
        assert row["result"] is None
    # A number a float holds only roughly is kept exactly: the text goes to a numeric.
    assert query(dsn, "SELECT result->>'n' AS n FROM tool_jobs WHERE id = $1",
                 exact)[0]["n"] == big_int
    failed = _row(dsn, nul_stderr)
    assert failed["state"] == "failed" and failed["error"]["kind"] == "exit_code"
    assert "\x00" not in failed["error"]["stderr_tail"]
    assert failed["error"]["stderr_tail"].endswith(" tail")
    _assert_work_dir_empty(work)


@pytest.mark.e2e
def test_terminal_escapes_from_the_tool_are_neutralised_in_text_logs(dsn, tmp_path):
    env, _ = _env(dsn, tmp_path, SIDECAR_LOG_FORMAT="text", SIDECAR_LOG_TOOL_STDERR="true")
    enqueue(dsn, "emit", {"mode": "emit", "stderr": _hex("\x1b]0;owned\x07\x1b[2Jplain\n")},
            env=env)
    done = _drain(dsn, env, "emit")
    text = done.stderr.decode()
    assert "plain" in text and "\x1b" not in text and "\x07" not in text


# --- payloads -----------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_payload_over_max_payload_bytes_is_refused_at_enqueue(dsn):
    env = base_env(dsn, SIDECAR_MAX_PAYLOAD_BYTES="100")
    big = orjson.dumps({"blob": "x" * 200})
    done = cli(dsn, "enqueue", "emit", "--payload-file", "-", input=big, env=env)
    assert done.returncode == 2
    assert "SIDECAR_MAX_PAYLOAD_BYTES=100" in done.stderr.decode()
    assert "Traceback" not in done.stderr.decode()
    assert query(dsn, "SELECT id FROM tool_jobs") == []
    small = cli(dsn, "enqueue", "emit", "--payload", '{"ok": 1}', env=env)
    assert small.returncode == 0, small.stderr.decode()



# --- found by trying README as a new user -------------------------------------------------

@pytest.mark.e2e
def test_a_relative_command_is_resolved_before_the_tool_moves_to_its_work_dir(dsn, tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(HOSTILE, tools / "hostile.py")
    env, _ = _env(dsn, tmp_path, SIDECAR_PROFILE_LOOK_ENV_PASSTHROUGH="PATH HOME")
    job = enqueue(dsn, "look", {"mode": "inspect"}, env=env)
    done = subprocess.run([sys.executable, "-m", "sidecar", "run", "--tool", "look", "--drain",
                           "--", "./tools/hostile.py"], cwd=tmp_path, env=env,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    row = _row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    # Space-separated names are two names, not one.
    assert {"PATH", "HOME"} <= set(row["result"]["env"])


@pytest.mark.e2e
def test_a_bad_result_file_is_named_in_the_error(dsn, tmp_path):
    env, _ = _env(dsn, tmp_path)
    job = enqueue(dsn, "big", {"mode": "result_file", "size": 10}, env=env)
    # The file holds {"blob": "rrrrrrrrrr"}: valid. Make a tool whose file is not JSON.
    bad = tmp_path / "bad_file.sh"
    bad.write_text("#!/bin/sh\n"
                   "printf '{\"fine\": true}'\n"  # valid on stdout, ignored
                   "printf '{oops' > \"$SIDECAR_RESULT_FILE\"\n")
    bad.chmod(0o755)
    broken = enqueue(dsn, "bad", {}, env=env)
    _drain(dsn, env, "big")
    _drain(dsn, env, "bad", command=(str(bad),))
    assert _row(dsn, job)["state"] == "succeeded"
    error = _row(dsn, broken)["error"]
    assert error["kind"] == "bad_result" and "SIDECAR_RESULT_FILE is not one JSON value" in \
        error["message"], error


@pytest.mark.e2e
def test_config_exits_2_when_run_would_refuse_a_profile(dsn, tmp_path):
    nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
    env = base_env(dsn, SIDECAR_PROFILE_WIDE_OPEN_FILES=str(nr_open + 1))
    done = cli(dsn, "config", env=env)
    assert done.returncode == 2
    [wide] = orjson.loads(done.stdout)["profiles"]
    assert "SIDECAR_PROFILE_WIDE_OPEN_FILES" in wide["isolation_error"]
    # A default the host cannot enforce is checked too.
    done = cli(dsn, "config", env=base_env(dsn, SIDECAR_CGROUPS="off", SIDECAR_PROCESSES="10"))
    assert done.returncode == 2
    assert "SIDECAR_PROCESSES=10" in orjson.loads(done.stdout)["defaults"]["isolation_error"]


@pytest.mark.unit
def test_a_tree_scan_refuses_an_empty_cookie():
    """An empty cookie matches every process's environment: a scan with one would take the
    whole host for the job's tree (and the tree kill would kill it)."""
    from sidecar.worker.child import find_tree

    for cookie in ({}, {"SIDECAR_JOB_ID": ""}):
        with pytest.raises(ValueError, match="cookie"):
            find_tree(os.getpid(), cookie)


@pytest.mark.unit
def test_the_paths_a_payload_names_under_what_the_sandbox_hides_are_found():
    """Issue 41, point 8: a tool given an input under /tmp, the work root or a secret's
    directory finds nothing inside the sandbox and fails with its own status; the sidecar
    names such paths of the payload (not one EXTRA_PATHS binds back, not a look-alike
    such as /tmpfoo or a relative a/tmp/b) in the failed job's hint."""
    from sidecar.worker.isolation import (
        SandboxPlan,
        hidden_path_hint,
        hidden_paths,
        hidden_paths_named,
    )

    plan = SandboxPlan("/usr/bin/bwrap", "/var/lib/sidecar/work", ("/run/secrets",),
                       ("/db-password",), "host", (("/tmp/inputs", "ro"),))
    assert hidden_paths(plan) == ["/db-password", "/run/secrets", "/tmp",
                                  "/var/lib/sidecar/work"]
    payload = ('{"image": "/tmp/scan 1.png", "args": ["--in=/run/secrets/x", '
               '"/tmp/inputs/ok.png", "/usr/share/tessdata", "/tmpfoo", "a/tmp/b", '
               '"/var/lib/sidecar/work/j1/f", "/tmp/scan", "/tmp/c", "/tmp/d"]}')
    assert hidden_paths_named(plan, payload) == ["/tmp/scan", "/run/secrets/x",
                                                 "/var/lib/sidecar/work/j1/f"]
    assert hidden_paths_named(plan, '{"image": "/srv/in/a.png", "n": "/tmpx"}') == []
    hint = hidden_path_hint(["/tmp/scan"])
    assert "/tmp/scan" in hint and "EXTRA_PATHS" in hint


@pytest.mark.unit
def test_a_mounted_path_that_names_something_else_now_is_seen(tmp_path):
    """mounts_moved: what a waiting sandbox mounted by name is re-checked by identity.
    A secrets' directory renamed away and replaced, a bound directory removed, a link
    turned to another directory: moved. Files added inside, or a mode changed: not moved
    (bwrap's mount still shows them)."""
    from sidecar.worker.isolation import mount_identities, mounts_moved

    secrets, inputs, v1, v2 = (tmp_path / n for n in ("secrets", "inputs", "v1", "v2"))
    for d in (secrets, inputs, v1, v2):
        d.mkdir()
    link = tmp_path / "current"
    link.symlink_to(v1)
    paths = [str(secrets), str(inputs), str(link)]
    seen = mount_identities(paths)
    assert all(identity is not None for _, identity in seen)
    assert not mounts_moved(seen) and not mounts_moved(())
    (secrets / "token").write_text("x")
    inputs.chmod(0o700)
    assert not mounts_moved(seen)
    secrets.rename(tmp_path / "secrets.old")
    secrets.mkdir()
    assert mounts_moved(seen)
    secrets.rmdir()
    (tmp_path / "secrets.old").rename(secrets)
    assert not mounts_moved(seen)
    inputs.rmdir()
    assert mounts_moved(seen) and dict(mount_identities(paths))[str(inputs)] is None
    inputs.mkdir()
    seen = mount_identities(paths)
    link.unlink()
    link.symlink_to(v2)
    assert mounts_moved(seen)
