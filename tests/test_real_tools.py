"""Real hang-prone tools under the default settings, each through `sidecar run` and the
recipe wrapper a user would copy from examples/recipes (README "Recipes"): headless
Chromium, tesseract, Ghostscript and LibreOffice (Debian's packages; `.ci/run` installs
them). After every job no process of its tree is left and the sidecar has no zombie.
A payload that names a file outside the recipe's root, or a URL other than http(s),
fails its job at once and gets nothing of that file back (issue 25, point 6)."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from kit import base_env, enqueue, job_processes, job_row, wait_until

pytestmark = pytest.mark.e2e

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


# A mounted database Secret, as the manifests mount it (k8s/base/deployment.yaml), at a
# path no recipe root covers.
PASSWORD = "s3cret-pw-4711"


@pytest.fixture
def db_secret(tmp_path) -> Path:
    secret = tmp_path / "etc" / "sidecar" / "db" / "url"
    secret.parent.mkdir(parents=True)
    secret.write_text(f"postgresql://sidecar_worker:{PASSWORD}@postgres:5432/jobs\n")
    return secret


def _refused_at_once(row: dict, *words: str) -> None:
    """Failed at its first attempt with exit 65 and one line naming why; the secret's
    content appears nowhere in the row."""
    assert row["state"] == "failed" and row["attempt"] == 1, row
    error = row["error"]
    assert (error["kind"], error.get("exit_code")) == ("exit_code", 65), error
    tail = error["stderr_tail"].strip()
    assert len(tail.splitlines()) == 1 and tail.startswith("bad payload: "), tail
    assert "Traceback" not in tail and all(w in tail for w in words), tail
    assert PASSWORD not in json.dumps(row, default=str)


@contextlib.contextmanager
def _http_server(directory: Path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                                directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


# --- Chromium --------------------------------------------------------------------------------


def test_chromium_dumps_an_http_pages_dom_with_the_default_profile(dsn, sidecars, tmp_path):
    _need("chromium")
    (tmp_path / "page.html").write_text('<html><body><p id="w">served over http</p></body></html>')
    env = _recipe_env(dsn, "chromium")
    with _http_server(tmp_path) as base:
        job = enqueue(dsn, "chromium", {"url": f"{base}/page.html"}, env=env)
        sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium",
                      env=env)
        [row] = _finished(dsn, sc, [job])
    assert row["state"] == "succeeded", row["error"]
    assert '<p id="w">served over http</p>' in row["result"]["dom"]


def test_chromium_refuses_a_file_url_of_the_secret(dsn, sidecars, tmp_path, db_secret):
    """Issue 25: `{"url": "file:///etc/sidecar/db/url"}` returned the database password as
    the DOM. File URLs are refused unless CHROMIUM_FILE_ROOT allows a directory, and then
    only under it (a symlink there to the Secret too)."""
    _need("chromium")
    pages = tmp_path / "pages"
    pages.mkdir()
    (pages / "link.html").symlink_to(db_secret)
    default = _recipe_env(dsn, "chromium")
    rooted = _recipe_env(dsn, "chromium", CHROMIUM_FILE_ROOT=str(pages))
    cases = [(default, [db_secret.as_uri()]),  # the case, alone: its DOM was the URL
             (default, ["file:///etc/sidecar/db/url", "FILE://localhost" + str(db_secret),
                        " " + db_secret.as_uri(), "view-source:" + db_secret.as_uri(),
                        "/etc/sidecar/db/url",
                        "--renderer-cmd-prefix=cat"]),  # was taken for a Chromium switch
             (rooted, [db_secret.as_uri(), (pages / "link.html").as_uri(),
                       pages.as_uri() + "/../etc/sidecar/db/url"])]
    for env, urls in cases:
        jobs = [enqueue(dsn, "chromium", {"url": url}, env=env) for url in urls]
        sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium",
                      "--drain", env=env)
        assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
        for job in jobs:
            _refused_at_once(job_row(dsn, job), "'url'")


def test_chromium_dumps_a_local_pages_dom_and_leaves_no_process(dsn, sidecars, tmp_path):
    _need("chromium")
    page = tmp_path / "page.html"
    page.write_text('<html><body><p id="x">hello from a real page</p></body></html>')
    env = _recipe_env(dsn, "chromium", CHROMIUM_FILE_ROOT=str(tmp_path))
    job = enqueue(dsn, "chromium", {"url": page.as_uri()}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "succeeded", row["error"]
    assert '<p id="x">hello from a real page</p>' in row["result"]["dom"]


def test_chromium_on_a_page_that_never_loads_ends_stage_timeout(dsn, sidecars, tmp_path):
    _need("chromium")
    page = tmp_path / "hang.html"
    page.write_text("<html><body><script>while(true){}</script></body></html>")
    env = _recipe_env(dsn, "chromium", SIDECAR_PROFILE_CHROMIUM_STAGE_TIMEOUT_SECONDS="8",
                      CHROMIUM_FILE_ROOT=str(tmp_path))
    job = enqueue(dsn, "chromium", {"url": page.as_uri()}, "--max-attempts", "1", env=env)
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "failed" and row["error"]["kind"] == "stage_timeout", row["error"]


def test_a_crashed_chromium_fails_its_job_instead_of_an_empty_dom(dsn, sidecars):
    _need("chromium")
    env = _recipe_env(dsn, "chromium", CHROMIUM_EXTRA_SCHEMES="chrome")  # allowed explicitly
    job = enqueue(dsn, "chromium", {"url": "chrome://crash"}, "--max-attempts", "1", env=env)
    sc = sidecars(dsn, [str(RECIPES / "chromium_dump_dom.py")], "--tool", "chromium", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "failed" and row["error"]["kind"] == "exit_code", row["error"]
    assert "no DOM" in row["error"]["stderr_tail"]


def test_four_chromium_jobs_at_concurrency_4_all_succeed(dsn, sidecars, tmp_path):
    _need("chromium")
    env = _recipe_env(dsn, "chromium", CHROMIUM_FILE_ROOT=str(tmp_path))
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
    env = _recipe_env(dsn, "tesseract", OCR_ROOT=str(tmp_path))
    job = enqueue(dsn, "ocr", {"image": str(image)}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "tesseract_ocr.py")], "--tool", "ocr", env=env)
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "succeeded", row["error"]
    assert row["result"]["text"].split() == ["lease", "heartbeat", "fencing"], row["result"]


def test_tesseract_reads_no_file_outside_its_root_nor_through_a_list(dsn, sidecars, tmp_path,
                                                                     db_secret):
    """Issue 25: `{"image": "/etc/sidecar/db/url"}` put the password in the job's error
    (tesseract reads a non-image as a list of file names and prints the line it cannot
    open). Outside OCR_ROOT a path is refused; inside it, a file that is no image is too,
    so a list there naming the Secret never reaches tesseract."""
    _need("tesseract")
    root = tmp_path / "scans"
    root.mkdir()
    (root / "list.txt").write_text(f"{db_secret}\n")
    (root / "secret.png").write_text(db_secret.read_text())  # the Secret, renamed
    (root / "link.png").symlink_to(db_secret)
    env = _recipe_env(dsn, "tesseract", OCR_ROOT=str(root))
    cases = [(str(db_secret), "OCR_ROOT"), ("/etc/sidecar/db/url", "OCR_ROOT"),
             (str(root / ".." / "etc" / "sidecar" / "db" / "url"), "OCR_ROOT"),
             (str(root / "link.png"), "OCR_ROOT"), ("scans/list.txt", "absolute"),
             (str(root / "list.txt"), "not a PNG"), (str(root / "secret.png"), "not a PNG")]
    jobs = [enqueue(dsn, "ocr", {"image": image}, env=env) for image, _ in cases]
    sc = sidecars(dsn, [str(RECIPES / "tesseract_ocr.py")], "--tool", "ocr", "--drain",
                  env=env)
    assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
    for job, (_, why) in zip(jobs, cases, strict=True):
        _refused_at_once(job_row(dsn, job), "'image'", why)


# --- Ghostscript ------------------------------------------------------------------------------


def test_ghostscript_renders_postscript_to_png(dsn, sidecars, tmp_path):
    _need("gs")
    source = tmp_path / "page.ps"
    source.write_text("%!PS\n/Helvetica findfont 24 scalefont setfont\n"
                      "72 720 moveto (rendered by the sidecar) show\nshowpage\n")
    env = _recipe_env(dsn, "ghostscript", RENDER_ROOT=str(tmp_path))
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
    env = _recipe_env(dsn, "ghostscript", SIDECAR_PROFILE_RENDER_STAGE_TIMEOUT_SECONDS="3",
                      RENDER_ROOT=str(tmp_path))
    job = enqueue(dsn, "render", {"input": str(source), "output_dir": str(tmp_path)}, env=env)
    sc = sidecars(dsn, [str(RECIPES / "ghostscript_render.py")], "--tool", "render", env=env)
    started = time.monotonic()
    [row] = _finished(dsn, sc, [job])
    assert row["state"] == "failed" and row["error"]["kind"] == "stage_timeout", row["error"]
    assert time.monotonic() - started < 30


def test_ghostscript_and_libreoffice_refuse_paths_outside_their_roots(dsn, sidecars, tmp_path,
                                                                      db_secret):
    """A document outside the root (the Secret) is not rendered or converted, and no output
    is written outside it: both fail at once with one line."""
    _need("gs")
    _need("soffice")
    root = tmp_path / "docs"
    root.mkdir()
    (root / "page.ps").write_text("%!PS\nshowpage\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for tool, recipe, script, variable in (
            ("render", "ghostscript", "ghostscript_render.py", "RENDER_ROOT"),
            ("convert-doc", "libreoffice", "libreoffice_convert.py", "CONVERT_DOC_ROOT")):
        env = _recipe_env(dsn, recipe, **{variable: str(root)})
        cases = [({"input": str(db_secret), "output_dir": str(root)}, "'input'"),
                 ({"input": str(root / "page.ps"), "output_dir": str(outside)}, "'output_dir'")]
        jobs = [enqueue(dsn, tool, payload, env=env) for payload, _ in cases]
        sc = sidecars(dsn, [str(RECIPES / script)], "--tool", tool, "--drain", env=env)
        assert sc.wait(60) == 0, sc.stderr_text()[-2000:]
        for job, (_, field) in zip(jobs, cases, strict=True):
            _refused_at_once(job_row(dsn, job), field, variable)
    assert not list(outside.iterdir())


# --- LibreOffice ------------------------------------------------------------------------------


def test_libreoffice_converts_two_documents_side_by_side(dsn, sidecars, tmp_path):
    """Two soffice instances at once work only because each attempt has its own HOME (a
    shared profile makes the second hand its work to the first or refuse)."""
    _need("soffice")
    env = _recipe_env(dsn, "libreoffice", CONVERT_DOC_ROOT=str(tmp_path))
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
