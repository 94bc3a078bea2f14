"""The one markdown table, the machine's description and ``bench/RESULTS.md``."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

COLUMNS = ("#", "measure", "sidecar", "baseline (same run)", "ratio", "target", "met?")


@dataclass
class Row:
    """One line of the table. ``met`` is True, False or None (no target)."""

    section: str
    measure: str
    value: str
    baseline: str = ""
    ratio: str = ""
    target: str = ""
    met: bool | None = None

    def cells(self) -> list[str]:
        if self.met is None:
            met = "n/a" if self.target else "-"  # a target, but nothing to compare with
        else:
            met = "yes" if self.met else "**NO**"
        return [self.section, self.measure, self.value, self.baseline, self.ratio,
                self.target or "-", met]


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_escape(c) for c in row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(pg_version: str) -> dict[str, str]:
    """What the figures were measured on."""
    load = os.getloadavg()
    return {
        "CPU": f"{cpu_model()}, {psutil.cpu_count(logical=False) or '?'} cores / "
               f"{psutil.cpu_count()} threads",
        "memory": f"{psutil.virtual_memory().total / 2**30:.1f} GiB",
        "OS": f"{platform.system()} {platform.release()}",
        "Python": f"{platform.python_implementation()} {sys.version.split()[0]}",
        "PostgreSQL": pg_version,
        "load average at the end": " / ".join(f"{x:.2f}" for x in load),
    }


def write_results(path: Path, mode_name: str, rows: list[Row], info: dict[str, str],
                  notes: list[str], settings: list[str], elapsed: float,
                  load_start: tuple[float, float, float]) -> str:
    text = table(rows)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# sidecar benchmark results\n",
        f"Written by `python -m bench{'' if mode_name == 'full' else ' --' + mode_name}` "
        f"on {when} ({mode_name} mode, {elapsed:.0f} s). Reproduce it from the repository "
        "root with `pip install -e '.[bench]'` then `python -m bench` (full), "
        "`python -m bench --medium` or `python -m bench --quick` (CI); `--dsn URL` picks the "
        "PostgreSQL server (default: `SIDECAR_DATABASE_URL`, else the embedded one). Each run "
        "creates a scratch database `bench_*` on that server and drops it at the end.\n",
        "## Machine\n",
        *(f"- {key}: {value}" for key, value in info.items()),
        f"- load average at the start: {' / '.join(f'{x:.2f}' for x in load_start)} "
        "(other work shares this machine; the figures carry its noise)\n",
        "## Results\n",
        text,
        "## Settings of this run\n",
        *(f"- {s}" for s in settings),
        "",
        "## Notes\n",
        *(f"- {n}" for n in notes),
        "",
    ]
    path.write_text("\n".join(parts), encoding="utf-8")
    return text
