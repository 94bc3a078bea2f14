"""The hostile-tool suite's driver (issue 25, point 2), shared by tests/test_containment.py
(a sidecar on this host) and packaging/image_check.py (a sidecar inside the image, as
non-root and as root, with a read-only root filesystem and the runtime's default seccomp
profile).

A sidecar of tool ``probe`` (concurrency 2) runs tests/tools/containment_probe.py. The
driver holds one attempt (it writes its guard token into its work directory and waits),
then runs the probe beside it, which tries to reach the secrets, the sidecar, the
guardian and the held attempt, and returns the probe's report. Every failure raises
AssertionError with what was waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson

from kit import enqueue, eventually, job_row

TOOL = "probe"


def _until(predicate, timeout: float, what: str):
    value = eventually(predicate, timeout, 0.05)
    if not value:
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
    return value


def probe_beside_held(dsn: str, work_root: Path, secrets: list[str],
                      pids: Callable[[], tuple[int, int]],
                      inside: Callable[[Path], str] = str) -> tuple[dict, Path]:
    """Hold one attempt, run the probe beside it, release the held one; return the
    probe's report (check -> "reached" | "blocked: ...") and the held attempt's work
    directory as this process sees it.

    ``work_root``: the sidecar's work root as this process sees it (a host directory
    mounted into a container, say). ``secrets``: paths the probe tries to read, as the
    tool would see them. ``pids()``: ``(sidecar pid, guardian pid)`` in the sidecar's own
    PID namespace. ``inside(path)``: a path under ``work_root`` as the sidecar sees it.
    """
    held = enqueue(dsn, TOOL, {"mode": "hold"})

    def held_dir():
        for entry in work_root.iterdir():
            if (entry / "token.txt").exists():
                return entry
        return None

    other = _until(held_dir, 30, "the held attempt's token.txt")
    sidecar_pid, guardian_pid = pids()
    probe = enqueue(dsn, TOOL, {
        "mode": "probe", "secrets": secrets, "sidecar_pid": sidecar_pid,
        "guardian_pid": guardian_pid, "other_dir": inside(other)})
    _until(lambda: job_row(dsn, probe)["state"] in ("succeeded", "failed"), 40,
           "the probe to end")
    row = job_row(dsn, probe)
    if row["state"] != "succeeded":
        raise AssertionError(f"the probe ended {row['state']}: {row['error']}")
    report = row["result"]
    report = orjson.loads(report) if isinstance(report, str | bytes) else report
    (other / "release").touch()
    _until(lambda: job_row(dsn, held)["state"] == "succeeded", 30, "the held attempt to end")
    return report, other


def reached(report: dict) -> set[str]:
    """The checks the probe reached, every secret named ``secret``."""
    return {("secret" if key.startswith("secret:") else key)
            for key, value in report.items() if value == "reached"}
