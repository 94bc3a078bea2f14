"""The benchmark's quick mode (what CI runs of it): `python -m bench --quick` against the test
database server exits 0, prints one markdown table with every section, and writes it with
the machine's description. Figures are not asserted: it is a benchmark, not a timed test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADER = "| # | measure | sidecar | baseline (same run) | ratio | target | met? |"


@pytest.mark.timeout(170)
def test_quick_bench_runs_every_section_and_prints_the_table(server_dsn, tmp_path):
    output = tmp_path / "RESULTS.md"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--dsn", server_dsn, "--output", str(output)],
        cwd=ROOT, env=env, capture_output=True, timeout=160)
    elapsed = time.monotonic() - started
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 0, f"exit {done.returncode} after {elapsed:.0f} s:\n{stderr[-4000:]}"

    lines = done.stdout.decode().strip().splitlines()
    assert lines[0] == HEADER, done.stdout.decode()
    assert re.fullmatch(r"\|(---\|)+", lines[1])
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[2:]]
    assert all(len(row) == 7 for row in rows), lines
    assert sorted({row[0] for row in rows}, key=int) == [str(n) for n in range(1, 11)]
    assert not [row for row in rows if "not measured" in row[1]]
    # Where a target is given, the table says whether it is met (n/a: the peers are not
    # installed, so there is nothing to compare with).
    assert all(row[6] in ("yes", "**NO**", "n/a") for row in rows if row[5] != "-")
    assert any(row[5] != "-" for row in rows)

    written = output.read_text()
    assert "\n".join(lines) in written
    for what in ("## Machine", "- CPU:", "- memory:", "- Python:", "- PostgreSQL:"):
        assert what in written
    print(f"python -m bench --quick took {elapsed:.0f} s")
