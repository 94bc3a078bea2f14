"""Helpers the tests and the benchmark share (one copy of each): where the test tools are,
reading a sidecar's JSON event log, stopping a process we started, and finding what is
left of a job's process tree. Imported as ``kit`` by tests/conftest.py and bench/common.py.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import orjson
import psutil

# The small real executables tests and the benchmark run as tools.
TOOLS = Path(__file__).resolve().parent / "tools"


def read_events(log_path: Path, name: str | None = None) -> list[dict[str, Any]]:
    """The JSON events of a sidecar's log file (its stderr), oldest first; only those named
    ``name`` when given. Lines that are not JSON objects are skipped; a missing file has
    none."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return []
    out = []
    for line in data.splitlines():
        if name is not None and name.encode() not in line:
            continue
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(event, dict) and (name is None or event.get("event") == name):
            out.append(event)
    return out


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM a process this code started (a sidecar drains on it), wait up to
    ``timeout`` seconds, then SIGKILL it; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait(5)


def job_processes(job_id: str) -> list[int]:
    """Live processes carrying the job's id in their environment (SIDECAR_JOB_ID): its
    whole tree, re-parented and ``setsid`` escapees included. Zombies count as gone."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("SIDECAR_JOB_ID") == job_id and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            continue
    return found
