"""The tool examples under examples/ run against the reference receiver: one effect per
operation key, fenced with the attempt's token, replayed (not repeated) on a retry. The
recipes (and the browser overlay's script) refuse input that reaches outside their root
or names a URL other than http(s): exit 65, one line, no traceback (issue 25, point 6);
tests/test_real_tools.py runs the same refusals through a sidecar with the real tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kit import base_env, cli, enqueue, query

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).parent.parent / "examples"


def _effects(url: str) -> list[dict]:
    with urllib.request.urlopen(url + "/effects", timeout=5) as response:
        return json.load(response)["effects"]


@pytest.mark.parametrize("example", ["create_case.sh", "create_case.py"])
def test_example_tool_sends_a_fenced_idempotent_effect(dsn, receiver, example):
    # The tool sees RECEIVER_URL only because its profile lets it through.
    env = base_env(dsn, RECEIVER_URL=receiver.url,
                   SIDECAR_PROFILE_CREATE_CASE_ENV_PASSTHROUGH="PATH,RECEIVER_URL")
    job_id = enqueue(dsn, "create-case", {"customer": "c-1048", "summary": "check invoice"},
                     env=env)
    done = cli(dsn, "run", "--tool", "create-case", "--drain", "--", str(EXAMPLES / example),
               env=env)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    job = query(dsn, "SELECT state, result, fencing_token FROM tool_jobs WHERE id = $1",
                job_id)[0]
    assert job["state"] == "succeeded", job
    assert job["result"]["status"] == 201
    [effect] = _effects(receiver.url)
    assert effect["idempotency_key"] == f"tool-job:{job_id}:create_case"
    assert effect["fence"] == job["fencing_token"] == 1
    assert effect["entity"] == f"tool-job:{job_id}"
    assert effect["body"] == {"customer": "c-1048", "summary": "check invoice"}

    # A second attempt of the same job (token 2) repeats the operation: the receiver
    # replays its answer instead of acting twice.
    query(dsn, "UPDATE tool_jobs SET state = 'queued', result = NULL WHERE id = $1", job_id)
    again = cli(dsn, "run", "--tool", "create-case", "--drain", "--", str(EXAMPLES / example),
                env=env)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    job = query(dsn, "SELECT state, result, fencing_token FROM tool_jobs WHERE id = $1",
                job_id)[0]
    assert job["state"] == "succeeded" and job["fencing_token"] == 2
    assert job["result"]["receiver"] == {"effect_id": effect["id"], "entity": effect["entity"],
                                         "fence": 1}
    assert len(_effects(receiver.url)) == 1


# --- recipes: input confined to a root, URLs to http(s) ----------------------------------

RECIPES = EXAMPLES / "recipes"
ROOTS = {"tesseract_ocr.py": "OCR_ROOT", "ghostscript_render.py": "RENDER_ROOT",
         "libreoffice_convert.py": "CONVERT_DOC_ROOT"}


def _recipe(script: Path, payload, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script)], input=json.dumps(payload).encode(),
                          env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                          timeout=30)


def _one_line(done: subprocess.CompletedProcess, code: int, start: str) -> str:
    err = done.stderr.decode()
    assert done.returncode == code and "Traceback" not in err, (done.returncode, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith(start), err
    assert done.stdout == b""
    return err


@pytest.fixture
def tree(tmp_path) -> dict[str, Path]:
    """A root with an input in it, and a secret beside the root, linked from inside."""
    root = tmp_path / "root"
    root.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("postgresql://u:pw@db/x")
    (root / "doc.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (root / "link").symlink_to(secret)
    return {"root": root, "secret": secret}


@pytest.mark.parametrize("script", sorted(ROOTS))
def test_a_path_recipe_refuses_paths_outside_its_root(script, tree):
    root, secret = tree["root"], tree["secret"]
    field = "image" if script.startswith("tesseract") else "input"
    inside = str(root / "doc.png")
    outs = [str(secret), "/etc/sidecar/db/url", str(root / "link"), f"{root}/../secret",
            "root/doc.png", "-dNOSAFER", "%pipe%cat /etc/passwd", inside + "\u0000x"]
    for value in outs:
        payload = {field: value, "output_dir": str(root)}
        err = _one_line(_recipe(RECIPES / script, payload, **{ROOTS[script]: str(root)}), 65,
                        "bad payload: ")
        assert f"'{field}'" in err, err
    if field == "input":  # where the output goes is confined too
        for value in (str(secret.parent), "/tmp", f"{root}/../"):
            err = _one_line(_recipe(RECIPES / script, {"input": inside, "output_dir": value},
                                    **{ROOTS[script]: str(root)}), 65, "bad payload: ")
            assert "'output_dir'" in err, err


@pytest.mark.parametrize("script", sorted(ROOTS))
def test_a_path_recipe_without_its_root_refuses_to_run(script, tree):
    """No root set: the recipe is not configured (exit 78, EX_CONFIG), whatever the path."""
    field = "image" if script.startswith("tesseract") else "input"
    payload = {field: str(tree["root"] / "doc.png"), "output_dir": str(tree["root"])}
    for env in ({}, {ROOTS[script]: "relative/dir"}):
        err = _one_line(_recipe(RECIPES / script, payload, **env), 78, ROOTS[script])
        assert "examples/recipes" in err


def test_the_ocr_recipe_gives_tesseract_images_only(tree):
    """tesseract takes a file it cannot decode for a list of file names to read: the
    recipe refuses any file that does not start as an image."""
    root = tree["root"]
    (root / "list.txt").write_text(f"{tree['secret']}\n")
    err = _one_line(_recipe(RECIPES / "tesseract_ocr.py", {"image": str(root / "list.txt")},
                            OCR_ROOT=str(root)), 65, "bad payload: ")
    assert "not a PNG" in err and "pw@" not in err
    for lang in ("-psm", "../../x", "eng;rm"):
        _one_line(_recipe(RECIPES / "tesseract_ocr.py", {"image": str(root / "doc.png"),
                                                         "lang": lang},
                          OCR_ROOT=str(root)), 65, "bad payload: 'lang'")


def test_the_libreoffice_recipe_takes_a_file_extension_as_format(tree):
    root = tree["root"]
    for fmt in ("../x", "pdf:writer_pdf_Export", "p df", "-env:x"):
        _one_line(_recipe(RECIPES / "libreoffice_convert.py",
                          {"input": str(root / "doc.png"), "output_dir": str(root),
                           "format": fmt}, CONVERT_DOC_ROOT=str(root)),
                  65, "bad payload: 'format'")


def test_the_chromium_recipe_loads_http_and_https_only_unless_allowed(tree):
    root, secret = tree["root"], tree["secret"]
    script = RECIPES / "chromium_dump_dom.py"
    refused = [secret.as_uri(), "file:///etc/sidecar/db/url", "FILE:///etc/passwd",
               " file:///etc/passwd", "view-source:file:///etc/passwd", "chrome://settings",
               "javascript:alert(1)", "data:text/html,x", "about:blank", "/etc/passwd",
               "--renderer-cmd-prefix=cat", "http://", "https:///etc/passwd",
               "http://[::1", "http://a b/"]
    for url in refused:
        err = _one_line(_recipe(script, {"url": url}), 65, "bad payload: 'url'")
        assert "pw@" not in err
    # Allowed explicitly: file URLs under CHROMIUM_FILE_ROOT only (not through a link out,
    # nor by .. out of it), and other schemes by name (never file).
    for url in (secret.as_uri(), (root / "link").as_uri(), root.as_uri() + "/../secret"):
        _one_line(_recipe(script, {"url": url}, CHROMIUM_FILE_ROOT=str(root)), 65,
                  "bad payload: 'url'")
    _one_line(_recipe(script, {"url": secret.as_uri()}, CHROMIUM_EXTRA_SCHEMES="file,data"),
              65, "bad payload: 'url'")
    _one_line(_recipe(script, {"url": (root / "doc.png").as_uri()},
                      CHROMIUM_FILE_ROOT="pages"), 78, "CHROMIUM_FILE_ROOT")


def test_the_browser_overlays_script_loads_http_and_https_only():
    script = EXAMPLES.parent / "k8s" / "overlays" / "browser" / "render.sh"
    for url in ("file:///etc/sidecar/db/url", "--renderer-cmd-prefix=cat", "chrome://crash",
                "http://a b", "javascript:x", ""):
        done = subprocess.run(["sh", str(script)], input=json.dumps({"url": url}).encode(),
                              capture_output=True, timeout=30)
        _one_line(done, 65, "bad payload: ")
