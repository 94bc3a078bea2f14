"""Every protocol rule (P<n>) and field case (F<n>) cited in the code, the tests, the
README and the deployment files is defined in docs/protocol.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "docs" / "protocol.md"
CITATION = re.compile(r"\b([PF])([0-9]{1,2})(?=[a-z]?\b)")
DEFINITION = re.compile(r"^\| ([PF][0-9]{1,3}) \|", re.MULTILINE)
CITING = ("sidecar", "tests", "bench", "k8s", "examples", "packaging", "docs")
SUFFIXES = {".py", ".md", ".sql", ".yaml", ".yml", ".sh", ".toml", ""}


def _citing_files():
    yield ROOT / "README.md"
    yield ROOT / "Dockerfile"
    for top in CITING:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def test_every_cited_rule_and_case_is_defined_in_docs_protocol():
    defined = set(DEFINITION.findall(PROTOCOL.read_text()))
    assert {f"P{n}" for n in range(1, 26)} <= defined
    assert {f"F{n}" for n in range(1, 25)} <= defined
    missing = {}
    for path in _citing_files():
        for kind, number in CITATION.findall(path.read_text(errors="replace")):
            if f"{kind}{number}" not in defined:
                missing.setdefault(f"{kind}{number}", []).append(str(path.relative_to(ROOT)))
    assert not missing, f"cited but not defined in docs/protocol.md: {missing}"


def test_readme_is_for_users_and_its_links_resolve():
    """README.md stays a short page for users (about 15 KB at most), opens with what the
    sidecar is and the two commands, has a table of contents, and every relative link in
    it and in docs/ points at a file that exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15 * 1024
    assert readme.index("pip install -q '.[embedded]'") < readme.index("## Contents")
    assert "python -m pytest -q" in readme
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
