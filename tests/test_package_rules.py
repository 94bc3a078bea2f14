"""The packages' import rules (issue 40, point 3): packages for the two ends and the ground.

- ``sidecar.protocol``, the pure protocol, imports nothing else of ours;
- ``sidecar.runtime`` (config, log, loop, tokens) imports only the protocol;
- ``sidecar.storage`` (db, store, queries, sql/) only the protocol and the runtime;
- ``sidecar.ops`` (metrics, health, tracing, retention, web, receiver, ...) only those three;
- ``sidecar.worker`` (the worker's end) and ``sidecar.client`` (the caller's end) do not
  import each other, directly or not;
- ``sidecar.mcp`` and the web view (``sidecar.ops.web``) reach jobs only through the
  caller's package and the store;
- no circle, between packages or between modules (the otel/tracing one included);
- on top, ``sidecar.cli``, ``sidecar.__main__`` and ``sidecar.demo`` may import anything.

The graph is read from the source with ``ast`` (nothing is imported): every ``import``
statement counts, at module level or inside a function, and importing ``sidecar.a.b`` runs
``sidecar`` and ``sidecar.a`` first, so the packages' ``__init__`` count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kit import chain

# Static analysis of the source: no database, no process.
pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"

# What each package may import besides itself and the root package ``sidecar`` (its
# __init__ only gives the version).
ALLOWED = {
    "protocol": set(),
    "runtime": {"protocol"},
    "storage": {"protocol", "runtime"},
    "ops": {"protocol", "runtime", "storage"},
    "worker": {"protocol", "runtime", "storage", "ops"},
    "client": {"protocol", "runtime", "storage"},
    "mcp": {"protocol", "runtime", "storage", "client"},
}
# The modules on top of the packages: they may import anything.
TOP = frozenset({"sidecar", "sidecar.cli", "sidecar.__main__", "sidecar.demo"})
# The caller-facing servers: they reach jobs only through these packages.
JOB_REACH = {"sidecar.mcp": {"protocol", "runtime", "storage", "client", "mcp"},
             "sidecar.ops.web": {"protocol", "runtime", "storage", "client", "ops.web"}}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def in_packages(path: Path) -> bool:
    """A module of the package, not a data file (demo_tools/ holds tools, not modules)."""
    return all((folder / "__init__.py").is_file()
               for folder in path.parents if folder.is_relative_to(PACKAGE))


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if in_packages(p)}


def imports_of(name: str, path: Path) -> set[str]:
    """The sidecar modules ``name`` imports (the packages that run first included)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names
                                if f"{base}.{a.name}" in MODULES]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            if parts[0] == "sidecar":
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1)
                             if ".".join(parts[:i]) in MODULES)
    found.discard(name)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def package_of(module: str) -> str | None:
    """``sidecar.storage.db`` -> ``storage``; None for the modules on top."""
    if module in TOP:
        return None
    return module.split(".")[1]


def reached(start: str) -> dict[str, str]:
    """Everything ``start`` imports, directly or not: {module: who imports it}."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in sorted(GRAPH.get(current, ())):
            if target not in via and target != start:
                via[target] = current
                todo.append(target)
    return via



def modules_of(package: str) -> list[str]:
    return sorted(m for m in MODULES if m == f"sidecar.{package}"
                  or m.startswith(f"sidecar.{package}."))


def test_every_module_is_in_a_package_or_on_top():
    """A new module goes into the package of what it owns (or on top, beside the CLI)."""
    stray = sorted(m for m in MODULES if m not in TOP and package_of(m) not in ALLOWED)
    assert not stray, f"modules outside the packages {sorted(ALLOWED)}: {stray}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_the_packages_below_it(package):
    allowed = ALLOWED[package] | {package}
    bad = sorted(f"{module} imports {target}"
                 for module in modules_of(package) for target in GRAPH[module]
                 if target != "sidecar" and (target in TOP or package_of(target) not in allowed))
    assert not bad, f"sidecar.{package} may import only {sorted(allowed)}: " + "; ".join(bad)


def test_the_protocol_imports_nothing_else_of_ours():
    bad = sorted(f"{m} imports {t}" for m in modules_of("protocol") for t in GRAPH[m]
                 if t != "sidecar" and not t.startswith("sidecar.protocol"))
    assert not bad, "; ".join(bad)


def test_the_root_package_imports_nothing_of_ours():
    """Every module runs ``sidecar/__init__.py`` first: it stays the version only."""
    assert GRAPH["sidecar"] == set()


@pytest.mark.parametrize("package", sorted(set(ALLOWED) - {"client"}))
def test_the_packages_init_imports_nothing(package):
    """``python -m sidecar.worker.guardian`` or ``import sidecar.protocol.verdict`` loads
    nothing more than the module asked for (sidecar.client's __init__ is the library)."""
    assert GRAPH[f"sidecar.{package}"] <= {"sidecar"}


@pytest.mark.parametrize("start,other", [("worker", "client"), ("client", "worker"),
                                         ("worker", "mcp"), ("client", "mcp")])
def test_the_two_ends_do_not_import_each_other(start, other):
    for module in modules_of(start):
        via = reached(module)
        bad = sorted(t for t in via if package_of(t) == other)
        assert not bad, "; ".join(chain(via, module, t) for t in bad)


@pytest.mark.parametrize("start", sorted(JOB_REACH))
def test_mcp_and_web_reach_jobs_only_through_the_callers_package_and_the_store(start):
    allowed = JOB_REACH[start]
    for module in [m for m in MODULES if m == start or m.startswith(start + ".")]:
        via = reached(module)
        bad = sorted(t for t in via if t != "sidecar" and not any(
            t == f"sidecar.{a}" or t.startswith(f"sidecar.{a}.") for a in allowed)
            and t not in ("sidecar.ops",))
        assert not bad, "; ".join(chain(via, module, t) for t in bad)


def test_the_cli_imports_the_callers_package_only_lazily():
    """`sidecar run` leaves the caller's library alone: sidecar.cli imports sidecar.client
    (``sidecar wait``) and sidecar.mcp (``sidecar mcp``) inside those commands only."""
    tree = ast.parse(MODULES["sidecar.cli"].read_text(encoding="utf-8"))
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            top.add(node.module or "")
            top.update(f"{node.module}.{a.name}" for a in node.names)
    bad = sorted(t for t in top if t.startswith(("sidecar.client", "sidecar.mcp")))
    assert not bad, bad


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_in_a_circle():
    """No circle of modules (a package's __init__ left out: it runs first, imports none)."""
    graph = {m: {t for t in targets if t not in TOP and not (
        MODULES[t].name == "__init__.py" and GRAPH[t] <= {"sidecar"})}
        for m, targets in GRAPH.items()}
    assert strongly_connected(graph) == []


def test_no_package_imports_itself_in_a_circle():
    graph: dict[str, set[str]] = {p: set() for p in ALLOWED}
    for module, targets in GRAPH.items():
        own = package_of(module)
        if own is None:
            continue
        graph[own].update(package_of(t) for t in targets
                          if package_of(t) not in (None, own))
    assert strongly_connected(graph) == []


def test_the_rules_see_the_packages():
    """The check itself: the graph finds the packages and the edges known to exist."""
    assert {"sidecar.protocol", "sidecar.storage", "sidecar.worker", "sidecar.client",
            "sidecar.mcp", "sidecar.ops", "sidecar.runtime"} <= set(MODULES)
    assert "sidecar.client" in GRAPH["sidecar.mcp.gateway"]
    assert "sidecar.worker.bootstrap" in GRAPH["sidecar.cli"]  # lazily, in cmd_run
    assert "sidecar.ops.otel" in GRAPH["sidecar.ops.tracing"]  # lazily, behind the seam
