"""The main job as a new user meets it: `sidecar demo`, and the embedded PostgreSQL that
every command shares when SIDECAR_DATABASE_URL is unset."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson
import psutil
import pytest

from kit import base_env, query, wait_until

pytestmark = pytest.mark.e2e


def test_demo_prints_real_results_and_the_hung_tool_killed(dsn):
    # As a new user runs it: no SIDECAR_* setting but the database (not the fast profile).
    env = {k: v for k, v in base_env(dsn).items()
           if not k.startswith("SIDECAR_") or k == "SIDECAR_DATABASE_URL"}
    refused = subprocess.run([sys.executable, "-m", "sidecar", "demo"], env=env,
                             capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    assert refused.returncode == 2 and b"--yes" in refused.stderr, refused.stderr
    assert query(dsn, "SELECT count(*) FROM tool_jobs")[0][0] == 0  # nothing written
    done = subprocess.run([sys.executable, "-m", "sidecar", "demo", "--yes"], env=env,
                          capture_output=True, timeout=60)
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert "stage_timeout" in out
    assert out.count("succeeded") >= 3
    rows = query(dsn, "SELECT tool, state, result, error FROM tool_jobs")
    hung = [r for r in rows if r["tool"] == "demo-hang"]
    assert len(hung) == 1 and hung[0]["state"] == "failed"
    assert hung[0]["error"]["kind"] == "stage_timeout"
    checksums = [r for r in rows if r["tool"] == "demo-checksum"]
    assert checksums and all(r["state"] == "succeeded" for r in checksums)
    passwd = [r["result"] for r in checksums if r["result"]["path"] == "/etc/passwd"]
    # a real checksum of a real file
    assert passwd[0]["sha256"] == hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()


def _stop_embedded(data_dir: Path) -> None:
    pidfile = data_dir / "postmaster.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text().split()[0])
    try:
        os.kill(pid, signal.SIGINT)  # fast shutdown
        psutil.Process(pid).wait(20)
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass


def test_commands_share_one_embedded_postgres_when_no_url_is_set():
    # Not under pytest's tmp_path: pytest resets its root to mode 0700, which the
    # unprivileged user the embedded server runs as (when we are root) cannot traverse.
    root = Path(tempfile.mkdtemp(prefix="sidecar-embedded-"))
    data_dir = root / "pg"
    env = base_env("unused")
    del env["SIDECAR_DATABASE_URL"]
    env["SIDECAR_DATA_DIR"] = str(data_dir)
    try:
        # Only `sidecar migrate` (or run, or demo) makes the schema, embedded or not.
        migrated = subprocess.run([sys.executable, "-m", "sidecar", "migrate"],
                                  env=env, capture_output=True, timeout=120)
        assert migrated.returncode == 0, migrated.stderr.decode()
        assert f"embedded PostgreSQL in {data_dir}" in migrated.stderr.decode()
        first = subprocess.run([sys.executable, "-m", "sidecar", "enqueue", "wc",
                                "--payload", '{"path": "/etc/hostname"}'],
                               env=env, capture_output=True, timeout=120)
        assert first.returncode == 0, first.stderr.decode()
        job_id = orjson.loads(first.stdout)["id"]
        # Another process, another command: the same queue.
        shown = subprocess.run([sys.executable, "-m", "sidecar", "show", job_id],
                               env=env, capture_output=True, timeout=60)
        assert shown.returncode == 0, shown.stderr.decode()
        job = orjson.loads(shown.stdout)
        assert job["state"] == "queued" and job["payload"] == {"path": "/etc/hostname"}
        assert shown.stderr.decode().count("embedded PostgreSQL") == 1  # said once
        pid = int((data_dir / "postmaster.pid").read_text().split()[0])
        wait_until(lambda: psutil.pid_exists(pid), 5, what="embedded server still running")
    finally:
        _stop_embedded(data_dir)
        shutil.rmtree(root, ignore_errors=True)
