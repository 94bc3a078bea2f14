"""Real hang-prone tools under the default settings, each through `sidecar run` and the
recipe wrapper a user would copy from examples/recipes (README "Recipes"): headless
Chromium, tesseract, Ghostscript and LibreOffice (Debian's packages; `.ci/run` installs
them). After every job no process of its tree is left and the sidecar has no zombie."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from kit import base_env, enqueue, job_processes, job_row, wait_until

RECIPES = Path(__file__).resolve().parent.parent / "examples" / "recipes"
# The recipes' lease profiles, with a lease wide enough for their kill graces (P10).
LEASE = {"SIDECAR_LEASE_SECONDS": "30", "SIDECAR_HEARTBEAT_SECONDS": "3"}
PACKAGES = {"chromium": "chromium", "tesseract": "tesseract-ocr", "gs": "ghostscript",
            "soffice": "libreoffice-writer-nogui", "convert-im6.q16": "imagemagick"}


def _need(binary: str) -> None:
    if shutil.which(binary) is None:
        pytest.fail(f"{binary} is not installed: apt-get install -y {PACKAGES[binary]} "
                    "(.ci/run installs every real tool these tests run)")


def _recipe_env(dsn: str, name: str, **extra: str) -> dict[str, str]:
    """base_env plus examples/recipes/<name>.env, as a user would load it."""
    env = base_env(dsn, **LEASE)
    for line in (RECIPES / f"{name}.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    env.update(extra)
    return env


def _zombie_children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()
                if c.status() == psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


def _finished(dsn: str, sc, jobs: list[str], timeout: float = 120) -> list[dict]:
    """Wait until every job is terminal; then nothing of theirs runs and the (still
    running) sidecar has reaped every child it adopted."""
    def done():
        rows = [job_row(dsn, job) for job in jobs]
        return rows if all(r["state"] in ("succeeded", "failed") for r in rows) else None

    rows = wait_until(done, timeout, interval=0.2, what=f"jobs {jobs} to finish")
    for job in jobs:
        wait_until(lambda job=job: not job_processes(job), 10,
                   what=f"no process of job {job} left")
    wait_until(lambda: not _zombie_children(sc.pid), 5, what="no zombie child of the sidecar")
    assert sc.proc.poll() is None, sc.stderr_text()[-2000:]
    return rows


# --- Chromium --------------------------------------------------------------------------------


def test_chromium_dumps_a_local_pages_dom_and_leaves_no_process(dsn, sidecars, tmp_path):
    _need("chromium")
    page = tmp_path / "page.html"
    page.write_text('<html><body><p id="x">hello from a real page</p></body></html>')
    env = _recipe_env(dsn, "chromium")
    job = enqueue(dsn, "chromium", {"url": page.as_uri()}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "succeeded", row["error"]
    assert '<p id="x">hello from a real page</p>' in row["result"]["dom"]


def test_chromium_on_a_page_that_never_loads_ends_stage_timeout(dsn, sidecars, tmp_path):
    _need("chromium")
    page = tmp_path / "hang.html"
    page.write_text("<html><body><script>while(true){}</script></body></html>")
    env = _recipe_env(dsn, "chromium", SIDECAR_PROFILE_CHROMIUM_STAGE_TIMEOUT_SECONDS="8")
    job = enqueue(dsn, "chromium", {"url": page.as_uri()}, "--max-attempts", "1", env=env)
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "failed" and row["error"]["kind"] == "stage_timeout", row["error"]


def test_a_crashed_chromium_fails_its_job_instead_of_an_empty_dom(dsn, sidecars):
    _need("chromium")
    env = _recipe_env(dsn, "chromium")
    job = enqueue(dsn, "chromium", {"url": "chrome://crash"}, "--max-attempts", "1", env=env)
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "failed" and row["error"]["kind"] == "exit_code", row["error"]
    assert "no DOM" in row["error"]["stderr_tail"]


def test_four_chromium_jobs_at_concurrency_4_all_succeed(dsn, sidecars, tmp_path):
    _need("chromium")
    env = _recipe_env(dsn, "chromium")
    jobs = []
    for n in range(4):
        page = tmp_path / f"page{n}.html"
        page.write_text(f"<html><body><p>page number {n}</p></body></html>")
        jobs.append(enqueue(dsn, "chromium", {"url": page.as_uri()}, env=env))
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium",
                  "--concurrency", "4", env=env)
    rows = _finished(dsn, sc, jobs)
    assert [r["state"] for r in rows] == ["succeeded"] * 4, [r["error"] for r in rows]
    for n, row in enumerate(rows):
        assert f"page number {n}" in row["result"]["dom"]


# --- tesseract --------------------------------------------------------------------------------


def test_tesseract_reads_back_text_rendered_by_imagemagick(dsn, sidecars, tmp_path):
    _need("tesseract")
    _need("convert-im6.q16")  # ImageMagick's own binary, whatever `convert` is on PATH
    image = tmp_path / "words.png"
    subprocess.run(["convert-im6.q16", "-size", "900x160", "xc:white", "-font", "DejaVu-Sans",
                    "-pointsize", "48", "-fill", "black", "-annotate", "+20+100",
                    "lease heartbeat fencing", str(image)], check=True, timeout=60)
    env = _recipe_env(dsn, "tesseract")
    job = enqueue(dsn, "ocr", {"image": str(image)}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "tesseract_ocr.py")], "--tool", "ocr", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "succeeded", row["error"]
    assert row["result"]["text"].split() == ["lease", "heartbeat", "fencing"], row["result"]


# --- Ghostscript ------------------------------------------------------------------------------


def test_ghostscript_renders_postscript_to_png(dsn, sidecars, tmp_path):
    _need("gs")
    source = tmp_path / "page.ps"
    source.write_text("%!PS\n/Helvetica findfont 24 scalefont setfont\n"
                      "72 720 moveto (rendered by the sidecar) show\nshowpage\n")
    env = _recipe_env(dsn, "ghostscript")
    job = enqueue(dsn, "render", {"input": str(source), "output_dir": str(tmp_path)}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "ghostscript_render.py")], "--tool", "render", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "succeeded", row["error"]
    [page] = row["result"]["pages"]
    assert Path(page).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_postscript_program_that_never_ends_is_stopped_at_the_stage_deadline(
        dsn, sidecars, tmp_path):
    _need("gs")
    source = tmp_path / "forever.ps"
    source.write_text("%!PS\n{} loop\n")
    env = _recipe_env(dsn, "ghostscript", SIDECAR_PROFILE_RENDER_STAGE_TIMEOUT_SECONDS="3")
    job = enqueue(dsn, "render", {"input": str(source), "output_dir": str(tmp_path)}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "ghostscript_render.py")], "--tool", "render", env=env)
    started = time.monotonic()
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "failed" and row["error"]["kind"] == "stage_timeout", row["error"]
    assert time.monotonic() - started < 30


# --- LibreOffice ------------------------------------------------------------------------------


def test_libreoffice_converts_two_documents_side_by_side(dsn, sidecars, tmp_path):
    """Two soffice instances at once work only because each attempt has its own HOME (a
    shared profile makes the second hand its work to the first or refuse)."""
    _need("soffice")
    env = _recipe_env(dsn, "libreoffice")
    jobs = []
    for name in ("first", "second"):
        doc = tmp_path / f"{name}.txt"
        doc.write_text(f"The {name} document, converted by LibreOffice under the sidecar.\n")
        jobs.append(enqueue(dsn, "convert-doc", {"input": str(doc),
                                                 "output_dir": str(tmp_path)}, env=env))
    sc = sidecars(dsn, [str(RECIPES / "libreoffice_convert.py")], "--tool", "convert-doc",
                  "--concurrency", "2", env=env)
    rows = _finished(dsn, sc, jobs, timeout=240)
    assert [r["state"] for r in rows] == ["succeeded"] * 2, [r["error"] for r in rows]
    for name, row in zip(("first", "second"), rows, strict=True):
        assert row["result"]["output"] == str(tmp_path / f"{name}.pdf")
        assert (tmp_path / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"
    # Both ran at once: their attempts overlapped in time.
    claims = sorted(e["ts"] for e in sc.events("job_claimed"))
    ends = sorted(e["ts"] for e in sc.events("job_succeeded"))
    assert claims[1] < ends[0], (claims, ends)
    assert not [p.pid for p in psutil.process_iter(["name"])
                if p.info["name"] in ("soffice.bin", "oosplash")
                and _job_env(p) in set(jobs)]


def _job_env(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("SIDECAR_JOB_ID")
    except (psutil.Error, OSError):
        return None
