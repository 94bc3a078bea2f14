"""The one markdown table, the machine's description and ``bench/RESULTS.md``."""

from __future__ import annotations

import datetime as dt
import os
import platform
import re
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
    # A row kept from an earlier results file (``--only``): its cells exactly as written.
    kept: tuple[str, ...] | None = None

    def cells(self) -> list[str]:
        if self.kept is not None:
            return list(self.kept)
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


_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_MET = {"yes": True, "**NO**": False}


@dataclass(frozen=True)
class Earlier:
    """What ``--only`` keeps of the results file it rewrites: the rows of the sections not
    run again, and the earlier run's first line, settings and notes (said to be its)."""

    rows: list[Row]
    written: str
    settings: list[str]
    notes: list[str]


def earlier_results(path: Path, run: set[str]) -> Earlier | None:
    """The rows of ``path`` (a results file this module wrote) whose section is not in
    ``run``, with that file's provenance; None when there is no such file or row."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    rows: list[Row] = []
    section, settings, notes, written = "", [], [], ""
    for line in text.splitlines():
        if line.startswith("Written by "):
            written = line
        elif line.startswith("## "):
            section = line[3:].strip()
        elif section == "Results" and line.startswith("| ") and not line.startswith("| #"):
            cells = [c.strip().replace("\\|", "|") for c in _CELL_SPLIT.split(line)[1:-1]]
            if len(cells) == len(COLUMNS) and cells[0] not in run:
                number, measure, value, baseline, ratio, target, met = cells
                rows.append(Row(number, measure, value, baseline, ratio,
                                "" if target == "-" else target, _MET.get(met),
                                kept=tuple(cells)))
        elif section.startswith("Settings") and line.startswith("- "):
            settings.append(line[2:])
        elif section == "Notes" and line.startswith("- "):
            notes.append(line[2:])
    if not rows:
        return None
    return Earlier(rows, written, settings, notes)


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
                  load_start: tuple[float, float, float],
                  earlier: Earlier | None = None) -> str:
    """Write the results file; with ``earlier`` (``--only``), the rows of the sections not
    run now are kept from the file it was read from, and the text says which rows come
    from which run."""
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if earlier is not None:
        fresh = sorted({r.section for r in rows}, key=int)
        rows = sorted([*rows, *earlier.rows], key=lambda r: int(r.section))
        notes = [f"Sections {', '.join(fresh)} were measured by the run above ({when}); "
                 "every other row is kept from the earlier run, whose own first line was: "
                 f"{earlier.written}", *notes,
                 *(f"(earlier run) {n}" for n in earlier.notes)]
        settings = [*settings, *(f"(earlier run) {s}" for s in earlier.settings)]
    text = table(rows)
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
