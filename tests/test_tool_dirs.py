"""The directories handed to a tool: room for unix socket paths under TMPDIR, HOME and
XDG_RUNTIME_DIR (Chromium's SingletonSocket aborted every job when they were too long),
and a private HOME with XDG base directories per attempt, so concurrent jobs of
Chromium or LibreOffice never share a profile."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import pytest

from kit import TOOLS, base_env, cli, enqueue, job_row, query, short_root
from sidecar.worker.isolation import MAX_WORK_ROOT_BYTES, SOCKET_NAME_BYTES, SOCKET_PATH_MAX_BYTES

pytestmark = pytest.mark.e2e

SOCKET_PATHS = str(TOOLS / "socket_paths.py")


def test_a_tool_can_bind_60_character_socket_names_under_tmpdir_home_and_runtime_dir(dsn):
    """Default settings (the work root is the system temp directory)."""
    job = enqueue(dsn, "sock", {})
    done = cli(dsn, "run", "--tool", "sock", "--drain", "--", SOCKET_PATHS)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    row = job_row(dsn, job)
    assert row["state"] == "succeeded", row["error"]
    result = row["result"]
    for key in ("tmpdir", "home", "runtime"):
        assert result[key] <= SOCKET_PATH_MAX_BYTES - (SOCKET_NAME_BYTES - 60), result
    assert result["runtime_mode"] == "0o700"


def test_the_longest_work_root_allowed_still_leaves_room_for_sockets(dsn, tmp_path):
    """A work root of exactly MAX_WORK_ROOT_BYTES: a 64-byte socket name fits under HOME."""
    root = Path("/tmp") / ("w" * (MAX_WORK_ROOT_BYTES - len("/tmp/")))
    assert len(str(root)) == MAX_WORK_ROOT_BYTES
    env = base_env(dsn, SIDECAR_WORK_DIR=str(root))
    job = enqueue(dsn, "sock", {}, env=env)
    try:
        done = cli(dsn, "run", "--tool", "sock", "--drain", "--", SOCKET_PATHS, env=env)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        result = job_row(dsn, job)["result"]
        assert result["home"] + (SOCKET_NAME_BYTES - 60) <= SOCKET_PATH_MAX_BYTES, result
    finally:
        for leftover in root.glob(".owner-*"):
            leftover.unlink()
        root.rmdir()


def test_a_work_root_too_long_for_socket_paths_is_refused_by_config_and_run(dsn, tmp_path):
    root = "/tmp/" + "w" * MAX_WORK_ROOT_BYTES
    env = base_env(dsn, SIDECAR_WORK_DIR=root)
    job = enqueue(dsn, "sock", {}, env=env)
    message = f"SIDECAR_WORK_DIR={root} is {len(root)} bytes long"
    shown = cli(dsn, "config", env=env)  # its JSON names the problem, and it exits 2
    assert shown.returncode == 2
    assert message in orjson.loads(shown.stdout)["defaults"]["isolation_error"]
    lines = shown.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    done = cli(dsn, "run", "--tool", "sock", "--drain", "--", SOCKET_PATHS, env=env)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and message in err, err
    assert job_row(dsn, job)["state"] == "queued"  # nothing was claimed
    assert not os.path.exists(root)


def test_concurrent_jobs_get_private_homes_that_are_removed_with_the_attempt(dsn):
    jobs = [enqueue(dsn, "sock", {"n": n}) for n in range(3)]
    done = cli(dsn, "run", "--tool", "sock", "--concurrency", "3", "--drain", "--",
               SOCKET_PATHS)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    homes = [job_row(dsn, job)["result"]["home_dir"] for job in jobs]
    assert len(set(homes)) == 3, homes
    assert not any(os.path.exists(home) for home in homes)


def test_home_inherit_and_an_absolute_path(dsn, tmp_path):
    own_home = tmp_path / "shared-home"
    own_home.mkdir()
    env = base_env(dsn, HOME=str(own_home), SIDECAR_PROFILE_INH_HOME="inherit",
                   SIDECAR_PROFILE_ABS_HOME=str(own_home), SIDECAR_STAGE_TIMEOUT_SECONDS="20")
    inherit = enqueue(dsn, "inh", {}, env=env)
    absolute = enqueue(dsn, "abs", {}, env=env)
    for tool in ("inh", "abs"):
        done = cli(dsn, "run", "--tool", tool, "--drain", "--", str(TOOLS / "print_env.py"),
                   env=env)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    seen_inherit = job_row(dsn, inherit)["result"]
    seen_absolute = job_row(dsn, absolute)["result"]
    assert _var(seen_inherit, "HOME") == str(own_home)  # passed through ENV_PASSTHROUGH
    assert _var(seen_inherit, "XDG_RUNTIME_DIR") is None
    assert _var(seen_absolute, "HOME") == str(own_home)
    [shown] = orjson.loads(cli(dsn, "config", "--tool", "abs", env=env).stdout)["profiles"]
    assert shown["home"] == str(own_home)


def test_a_bad_home_value_is_refused_in_one_line(dsn):
    env = base_env(dsn, SIDECAR_PROFILE_BAD_HOME="relative/dir")
    done = cli(dsn, "config", "--tool", "bad", env=env)
    err = done.stderr.decode()
    assert done.returncode == 2 and "SIDECAR_PROFILE_BAD_HOME='relative/dir'" in err, err
    assert "job" in err and "inherit" in err and "Traceback" not in err
    assert query(dsn, "SELECT count(*) FROM tool_jobs")[0][0] == 0


def _var(result, name):
    env = result.get("env", result)
    return env.get(name)


def test_an_untouched_work_directory_is_reused_and_a_touched_one_never(dsn, tmp_path):
    """One sidecar, one job at a time: an attempt that left its work directory as made
    and no process behind hands it, still locked, to the next attempt (six metadata
    operations fewer a job); one that wrote in HOME, changed a mode or left a process
    gets it removed, and the next attempt starts in a new, empty one. So does one that
    left a file at the top or in the runtime directory, or put an exact replica in the
    directory's place (only the locked descriptor tells them apart). At shutdown no
    work directory is left."""
    root = short_root(tmp_path / "w")
    # Cold starts, so each attempt is the next one's predecessor (prepared attempts: below).
    env = base_env(dsn, SIDECAR_WORK_DIR=str(root), SIDECAR_PREPARE="false")
    modes = ["clean", "clean", "write", "clean", "chmod", "clean", "child", "clean",
             "top", "clean", "runtime", "clean", "swap", "clean"]
    jobs = [enqueue(dsn, "reuse", {"mode": mode}, env=env) for mode in modes]
    done = cli(dsn, "run", "--tool", "reuse", "--drain", "--", str(TOOLS / "dir_reuse.sh"),
               env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    results = [job_row(dsn, job)["result"] for job in jobs]
    dirs = [r["dir"] for r in results]
    assert all(r["home_had"] == "" for r in results), results  # every HOME started empty
    assert dirs[1] == dirs[0]                    # clean -> reused
    assert dirs[2] == dirs[1]                    # (the writer got the clean one)
    assert dirs[3] != dirs[2]                    # it wrote in HOME: removed, a new one
    assert dirs[4] == dirs[3] and dirs[5] != dirs[4]    # chmod: removed
    assert dirs[6] == dirs[5] and dirs[7] != dirs[6]    # a process left behind: removed
    for touched in (8, 10, 12):                          # top, runtime, swap: the same
        assert dirs[touched] == dirs[touched - 1] and dirs[touched + 1] != dirs[touched], \
            (modes[touched], dirs)
    # The original the swap renamed away still carries the owner's prefix: swept too.
    assert not any(os.path.exists(d) for d in [*dirs, dirs[12] + ".old"])
    assert [p.name for p in root.iterdir() if ".j" in p.name] == []  # none at shutdown


def test_prepared_attempts_reuse_untouched_work_directories_and_never_a_touched_one(
        dsn, tmp_path):
    """With attempts prepared ahead (issue 42, the default), the next attempt is set up
    while a job runs, so an untouched directory goes to the attempt prepared after its
    job ended: reused all the same (two directories take turns), and one that a tool
    touched is never seen again. At shutdown no work directory is left."""
    root = short_root(tmp_path / "w")
    env = base_env(dsn, SIDECAR_WORK_DIR=str(root))
    modes = ["clean"] * 5 + ["write"] + ["clean"] * 4 + ["chmod"] + ["clean"] * 4
    jobs = [enqueue(dsn, "reuse-prep", {"mode": mode}, env=env) for mode in modes]
    done = cli(dsn, "run", "--tool", "reuse-prep", "--drain", "--",
               str(TOOLS / "dir_reuse.sh"), env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    dirs = [job_row(dsn, job)["result"]["dir"] for job in jobs]
    assert all(job_row(dsn, job)["result"]["home_had"] == "" for job in jobs)
    assert len(set(dirs[:5])) < 5, dirs  # clean ones come back
    for touched, mode in enumerate(modes):
        if mode != "clean":
            assert dirs[touched] not in dirs[touched + 1:], (mode, dirs)
    assert [p.name for p in root.iterdir() if ".j" in p.name] == []  # none at shutdown


def test_without_a_job_cgroup_no_work_directory_is_reused(dsn, tmp_path):
    """No cgroup, no proof that nothing of the tool is left (a descendant that hid from
    the tree kill could still sit in the directory): every attempt gets a new one."""
    env = base_env(dsn, SIDECAR_WORK_DIR=str(short_root(tmp_path / "w")),
                   SIDECAR_CGROUPS="off")
    jobs = [enqueue(dsn, "reuse-off", {"mode": "clean"}, env=env) for _ in range(3)]
    done = cli(dsn, "run", "--tool", "reuse-off", "--drain", "--",
               str(TOOLS / "dir_reuse.sh"), env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    dirs = [job_row(dsn, job)["result"]["dir"] for job in jobs]
    assert len(set(dirs)) == 3 and not any(os.path.exists(d) for d in dirs)


def test_a_work_directory_renamed_away_by_its_tool_is_not_reused(dsn, tmp_path):
    """A tool that renames its work directory away and leaves a look-alike in its place
    (right names, modes, empty): the look-alike is not the directory the attempt locked,
    so it is removed, not handed on."""
    root = short_root(tmp_path / "w")
    env = base_env(dsn, SIDECAR_WORK_DIR=str(root))
    tool = tmp_path / "swap.sh"
    tool.write_text('#!/bin/sh\ncat >/dev/null\nd="$SIDECAR_JOB_DIR"\ncd /\n'
                    'mv "$d" "$d.away" && mkdir -m 0700 "$d" "$d/h" "$d/r"\n'
                    'printf \'{"dir": "%s"}\\n\' "$d"\n')
    tool.chmod(0o755)
    first = enqueue(dsn, "swap", {}, env=env)
    second = enqueue(dsn, "swap", {}, env=env)
    done = cli(dsn, "run", "--tool", "swap", "--drain", "--", str(tool), env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    dirs = [job_row(dsn, job)["result"]["dir"] for job in (first, second)]
    assert dirs[0] != dirs[1]
