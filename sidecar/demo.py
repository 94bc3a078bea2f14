"""``sidecar demo``: the main job on real input, end to end, in well under 30 s.

It migrates, enqueues checksum/word-count jobs for real files of this machine (the
system's ``sha256sum`` and ``wc`` wrapped to print JSON) plus one job whose tool hangs
and ignores SIGTERM, runs one sidecar worker per tool with a short stage deadline, and
prints a table of outcomes: the real results, and the hung job killed as stage_timeout.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from sidecar.protocol.model import JobState
from sidecar.protocol.vocabulary import FailureKind
from sidecar.runtime import log as log_mod
from sidecar.runtime.config import Settings, load_settings
from sidecar.runtime.loop import run_async
from sidecar.storage import db
from sidecar.storage.caller_store import CallerStore
from sidecar.worker.claim_loop import Worker

TOOLS = Path(__file__).parent / "demo_tools"
CANDIDATE_FILES = ["/etc/os-release", "/etc/passwd", "/etc/services", "/etc/hostname",
                   sys.executable, "/bin/sh"]

# Short lease and deadline so the hung tool is dealt with in seconds (P10 holds: 6 > 1 + 2).
DEMO_PROFILE = {
    "SIDECAR_PROFILE_DEMO_CHECKSUM_LEASE_SECONDS": "6",
    "SIDECAR_PROFILE_DEMO_CHECKSUM_HEARTBEAT_SECONDS": "1",
    "SIDECAR_PROFILE_DEMO_CHECKSUM_JITTER_SECONDS": "2",
    "SIDECAR_PROFILE_DEMO_CHECKSUM_KILL_GRACE_SECONDS": "1",
    "SIDECAR_PROFILE_DEMO_HANG_LEASE_SECONDS": "6",
    "SIDECAR_PROFILE_DEMO_HANG_HEARTBEAT_SECONDS": "1",
    "SIDECAR_PROFILE_DEMO_HANG_JITTER_SECONDS": "2",
    "SIDECAR_PROFILE_DEMO_HANG_STAGE_TIMEOUT_SECONDS": "2",
    "SIDECAR_PROFILE_DEMO_HANG_KILL_GRACE_SECONDS": "1",
    "SIDECAR_PROFILE_DEMO_HANG_MAX_ATTEMPTS": "1",
}


def _summary(row) -> str:
    if row["state"] == JobState.SUCCEEDED:
        r = row["result"]
        return (f"sha256 {r['sha256'][:16]}…  {r['lines']} lines  {r['words']} words  "
                f"{r['bytes']} bytes")
    error = row["error"] or {}
    return f"{error.get('kind', '?')}: {error.get('message', '')}"


async def _demo(settings: Settings) -> int:
    dsn = db.resolve_dsn(settings)
    pool = await db.create_pool(dsn, settings.db_timeout_seconds, max_size=2)
    store = CallerStore(pool, settings.db_timeout_seconds)
    try:
        await store.migrate()
        jobs = []
        files = [f for f in CANDIDATE_FILES if os.path.isfile(f)]
        for path in files:
            job_id, _ = await store.enqueue("demo-checksum", {"path": path}, None, 1, {})
            jobs.append((job_id, path))
        hang_id, _ = await store.enqueue("demo-hang", {"url": "https://example.invalid/"},
                                         None, 1, {})
        jobs.append((hang_id, "(hangs, ignores SIGTERM)"))
        print(f"sidecar demo: {len(jobs)} jobs queued; running two sidecar workers...",
              file=sys.stderr)
        checksum = Worker(settings, settings.profile("demo-checksum"), dsn,
                          [sys.executable, str(TOOLS / "file_stats.py")], concurrency=2,
                          drain=True)
        hang = Worker(settings, settings.profile("demo-hang"), dsn,
                      [sys.executable, str(TOOLS / "hang.py")], concurrency=1, drain=True)
        codes = await asyncio.gather(checksum.run(), hang.run())
        rows = [(await store.get_job(job_id), label) for job_id, label in jobs]
    finally:
        await pool.close()

    print(f"{'job':<36}  {'tool':<13}  {'input':<24}  {'state':<9}  outcome")
    for row, label in rows:
        shown = label if len(label) <= 24 else label[:23] + "…"
        print(f"{row['id']}  {row['tool']:<13}  {shown:<24}  {row['state']:<9}  "
              f"{_summary(row)}")
    print("\nInspect one with: sidecar show JOB_ID  (its row, journal and forwarding)")
    ok = all(r["state"] == JobState.SUCCEEDED for r, _ in rows[:-1]) and \
        rows[-1][0]["error"]["kind"] == FailureKind.STAGE_TIMEOUT
    print("\nEvery real file got its checksum; the hung tool was killed at its stage deadline"
          if ok else "\nUnexpected outcome: see the table and 'sidecar show JOB_ID'")
    return 0 if ok and codes == [0, 0] else 1


def run_demo(settings: Settings) -> int:
    """Run the demo; return 0 when every outcome is the expected one."""

    env = dict(os.environ)
    for key, value in DEMO_PROFILE.items():
        env.setdefault(key, value)
    settings = load_settings(env)
    if "SIDECAR_LOG_LEVEL" not in os.environ:
        log_mod.configure("warning", settings.log_format)
    return run_async(settings, _demo(settings))
