"""Every protocol rule (P<n>) and field case (F<n>) cited in the code, the tests, the
README and the deployment files is defined in docs/protocol.md; every log and journal
event the code emits is in the catalog of docs/operations.md, and the catalog names no
other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

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


# --- the event catalog ----------------------------------------------------------------------
# Every event the code emits is found statically: log events are the first argument of
# ``<log>.emit(NAME, LEVEL, ...)``; journal events are the ``event: str`` argument of the
# functions that write the journal (WorkerStore.record_event, FencedCommit.note, ...), the events
# a lease keeps to journal later (``unjournaled.append((NAME, ...))``), and the literal
# event of every INSERT INTO tool_job_events in sidecar/sql.

OPERATIONS = ROOT / "docs" / "operations.md"
SIDECAR = ROOT / "sidecar"
CATALOG_ROW = re.compile(r"^\| `([a-z0-9_]+)` \| ([a-z, —-]+) \| (log|journal|both) \| [^|]+\|$",
                         re.MULTILINE)
SQL_EVENT = (
    # INSERT INTO tool_job_events (job_id, fencing_token, event, ...) SELECT a, b, 'NAME', ...
    re.compile(r"INSERT INTO tool_job_events\s*\([^)]*\)\s*SELECT\s+[^,]+,\s*[^,]+,\s*'(\w+)'"),
    # ... tool_job_journal_rows(earlier, 'NAME', details): the final event after the earlier
    re.compile(r"tool_job_journal_rows\(\s*[^,]+,\s*'(\w+)'"),
)


def _literals(node: ast.AST) -> list[str] | None:
    """The strings a name or level argument can be: a literal, or either side of ``a if c
    else b``; None when the code computes it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _literals(node.body), _literals(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _modules():
    for path in sorted(SIDECAR.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            yield node


def _callee(call: ast.Call) -> tuple[str, bool]:
    """The called name, and whether it is called as an attribute (a method)."""
    if isinstance(call.func, ast.Attribute):
        return call.func.attr, True
    return call.func.id, False


def _argument(call: ast.Call, name: str, index: int | None) -> ast.AST | None:
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    if index is not None and index < len(call.args):
        return call.args[index]
    return None


def _outcome_reports(tree: ast.AST) -> list[tuple[str, str]]:
    """(event, level) of each ``OutcomeReport("event", "level", ...)`` in a module."""
    return [(call.args[0].value, call.args[1].value) for call in _calls(tree)
            if _callee(call) == ("OutcomeReport", False) and len(call.args) >= 2
            and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
            and isinstance(call.args[1], ast.Constant)]


def _log_events() -> tuple[dict[str, set[str]], list[str]]:
    """{event: levels} of every ``.emit(...)`` call in sidecar/, and the places whose event
    name is computed (which this test cannot check)."""
    found: dict[str, set[str]] = {}
    unresolved = []
    # A periodic service (sidecar.ops.periodic.Periodic) emits the ``error_event`` it is given,
    # as a warning: each literal ``error_event=`` of a call is such an event.
    given = [name for _, tree in _modules() for call in _calls(tree)
             for kw in call.keywords if kw.arg == "error_event"
             for name in (_literals(kw.value) or [])]
    for path, tree in _modules():
        for call in _calls(tree):
            if _callee(call) != ("emit", True) or not call.args:
                continue
            names = _literals(call.args[0])
            if names is None and ast.unparse(call.args[0]) == "self.error_event" \
                    and path.name == "periodic.py":
                names = given
            if names is None and ast.unparse(call.args[0]) == "report.event" \
                    and path.name == "commit.py":
                # An attempt's outcome line: its event and level come from the one table,
                # ENDING_REPORTS (sidecar.worker.commit), read as written.
                for event, level in _outcome_reports(tree):
                    found.setdefault(event, set()).add(level)
                continue
            if names is None:
                unresolved.append(f"{path.relative_to(ROOT)}:{call.lineno}")
                continue
            level = _argument(call, "level", 1)
            levels = ["info"] if level is None else _literals(level)
            if levels is None:  # computed: the catalog's level is not checked for it
                levels = ["?"]
            elif len(levels) == len(names) > 1:  # ``a if c else b`` in both: paired
                for event, one in zip(names, levels, strict=True):
                    found.setdefault(event, set()).add(one)
                continue
            for event in names:
                found.setdefault(event, set()).update(levels)
    return found, unresolved


def _journal_events() -> set[str]:
    """Every event name the code writes, or keeps to write, into tool_job_events."""
    writers: dict[tuple[str, bool], int | None] = {}  # (name, method?) -> index of ``event``
    for _, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or \
                    node.name == "emit" or node.name.startswith("__"):
                continue
            params = [*node.args.posonlyargs, *node.args.args]
            event = next((a for a in [*params, *node.args.kwonlyargs] if a.arg == "event"), None)
            if event is None or "str" not in ast.unparse(event.annotation or ast.Constant("")):
                continue
            method = bool(params) and params[0].arg in ("self", "cls")
            staticmethod = any(ast.unparse(d) == "staticmethod" for d in node.decorator_list)
            index = params.index(event) - method if event in params else None
            writers[(node.name, method or staticmethod)] = index
    found: set[str] = set()
    for _, tree in _modules():
        for call in _calls(tree):
            name, as_attribute = _callee(call)
            argument = None
            if (name, as_attribute) in writers:
                argument = _argument(call, "event", writers[(name, as_attribute)])
            elif name == "keep_for_journal" and as_attribute and call.args \
                    and isinstance(call.args[0], ast.List) and call.args[0].elts \
                    and isinstance(call.args[0].elts[0], ast.Tuple):
                # Lease.keep_for_journal([(event, details)]): written once the database
                # answers (sidecar.protocol.lease_state)
                argument = call.args[0].elts[0].elts[0]
            if argument is not None:
                found.update(_literals(argument) or [])
    for sql in sorted(SIDECAR.rglob("*.sql")):
        text = sql.read_text()
        for pattern in SQL_EVENT:
            found.update(pattern.findall(text))
    return found


def _catalog() -> dict[str, tuple[set[str], str]]:
    """{event: (levels, "log" | "journal" | "both")} of the table in docs/operations.md."""
    rows = CATALOG_ROW.findall(OPERATIONS.read_text())
    names = [name for name, _, _ in rows]
    assert len(names) == len(set(names)), "an event is in the catalog twice"
    return {name: ({lv.strip() for lv in levels.split(",") if lv.strip() not in "—-"}, where)
            for name, levels, where in rows}


def test_the_event_catalog_in_docs_operations_names_every_event_the_code_emits():
    """docs/operations.md has one row per log or journal event: its name, level, where it
    goes (log, journal or both) and what it means. Every event the code emits is there,
    where it goes and at the level it is logged; the catalog names no other event."""
    logged, unresolved = _log_events()
    journaled = _journal_events()
    assert not unresolved, (
        f"log events named by computed values at {unresolved}: name them with literals "
        "(or `a if c else b`) so the catalog test can read them")
    assert len(logged) > 40 and len(journaled) > 15  # the scan still finds what it looks for
    catalog = _catalog()
    emitted = {name: ("both" if name in logged and name in journaled else
                      "log" if name in logged else "journal")
               for name in logged.keys() | journaled}
    missing = sorted(set(emitted) - set(catalog))
    assert not missing, f"emitted but not in the catalog in docs/operations.md: {missing}"
    stale = sorted(set(catalog) - set(emitted))
    assert not stale, f"in the catalog in docs/operations.md but emitted nowhere: {stale}"
    wrong_place = {name: (catalog[name][1], where) for name, where in emitted.items()
                   if catalog[name][1] != where}
    assert not wrong_place, f"(catalog says, code does): {wrong_place}"
    wrong_level = {name: (sorted(catalog[name][0]), sorted(levels))
                   for name, levels in logged.items()
                   if "?" not in levels and catalog[name][0] != levels}
    assert not wrong_level, f"levels (catalog says, code logs): {wrong_level}"
