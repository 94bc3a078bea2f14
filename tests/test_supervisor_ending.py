"""One way to end an attempt (issue 40, point 4): the supervisor hands every attempt's
ending (sidecar.protocol.verdict.Ending) to one call, ``FencedCommit.end``, which picks the one
fenced statement of its kind (``_ENDERS``), reports it once (``ENDING_REPORTS``) and counts
it. Read from the source with ``ast`` and from the tables themselves: no database, no
process. That each way of ending still writes, journals and logs what it did is shown by
the database and e2e tests (test_lease_protocol, test_fence, test_lost_answers, ...).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import get_args

import pytest

from sidecar.protocol.verdict import (
    Commit,
    Failure,
    Park,
    Reject,
    Release,
    Snooze,
    Succeeded,
    Verdict,
)
from sidecar.protocol.vocabulary import LEASE_ENDINGS
from sidecar.worker.commit import (
    _ENDERS,
    ACKNOWLEDGING_OUTCOMES,
    ENDING_REPORTS,
    LEASE_ENDING_OUTCOMES,
    FencedCommit,
)

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"

# The fenced statements (sidecar.storage.worker_store.WorkerStore) that write an attempt's end.
ENDING_STATEMENTS = frozenset({"finish_if_owner", "requeue_if_owner", "release_if_owner",
                               "snooze_if_owner", "park_if_owner"})
# FencedCommit's own ways of writing: only end() may be called from outside.
COMMIT_INTERNALS = frozenset({"_succeed", "_fail", "_release", "_snooze", "_park",
                              "_lease_ended",
                              "_abandon",
                              "reject", "_fenced", "_write", "_count"})
# Which fenced statements each kind of ending may run: a success commits (finish), a
# failure requeues while attempts are left or finishes it failed, a release gives the
# lease back, a snooze queues the job again (past its bounds it fails, through _fail); a
# lease that ended writes no outcome (only the journal).
STATEMENTS_OF = {
    Succeeded: {"finish_if_owner"},
    Failure: {"requeue_if_owner", "finish_if_owner"},
    Release: {"release_if_owner"},
    Snooze: {"snooze_if_owner"},
    Park: {"park_if_owner"},
    Reject: set(),
}


def _tree(module: str) -> ast.Module:
    path = PACKAGE / f"{module}.py"
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _method_calls(node: ast.AST) -> list[ast.Call]:
    """Every call of an attribute (``x.name(...)``) under ``node``."""
    return [call for call in ast.walk(node)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)]


def _functions(tree: ast.Module, class_name: str) -> dict[str, ast.AST]:
    """The methods of ``class_name`` by name."""
    cls = next(node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name == class_name)
    return {node.name: node for node in cls.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_the_supervisor_ends_an_attempt_by_one_call_of_fenced_commit_end():
    """Exactly one ``self.commit.end(...)`` in sidecar/worker/supervisor.py, in
    ``JobSupervisor.run``; no fenced statement and no FencedCommit internal is called from
    it, so no path of an attempt can end it another way."""
    tree = _tree("worker/supervisor")
    ends = [call for call in _method_calls(tree) if call.func.attr == "end"]
    assert len(ends) == 1, [ast.unparse(call) for call in ends]
    assert ast.unparse(ends[0].func) == "self.commit.end"
    run = _functions(tree, "JobSupervisor")["run"]
    assert ends[0] in _method_calls(run)
    bad = sorted(ast.unparse(call.func) for call in _method_calls(tree)
                 if call.func.attr in COMMIT_INTERNALS or call.func.attr.endswith("_if_owner")
                 or (isinstance(call.func.value, ast.Attribute)
                     and call.func.value.attr == "store"))
    assert not bad, f"sidecar/worker/supervisor.py ends or writes an attempt besides end(): {bad}"


def test_every_verdict_becomes_an_ending_with_its_ender():
    """Each entry of the dispatch table is a FencedCommit coroutine (that it covers the
    Ending union is test_commit_tables'); every verdict is an ending once a Commit's output
    is checked into Succeeded, so no verdict of sidecar.protocol.verdict.decide lacks an ender."""
    for kind, ender in _ENDERS.items():
        assert getattr(FencedCommit, ender.__name__) is ender, kind
        assert inspect.iscoroutinefunction(ender), kind
    verdicts = {Succeeded if kind is Commit else kind for kind in get_args(Verdict)}
    assert verdicts == set(_ENDERS)


def test_each_ender_runs_only_the_fenced_statements_of_its_kind():
    """Ending -> statement, read from sidecar/worker/commit.py: each ender calls its own fenced
    statements (STATEMENTS_OF) and no other method of FencedCommit calls one, so a write
    of an attempt's end happens only under end()."""
    methods = _functions(_tree("worker/commit"), "FencedCommit")

    def statements(node: ast.AST) -> set[str]:
        return {call.func.attr for call in _method_calls(node)
                if call.func.attr in ENDING_STATEMENTS}

    for kind, ender in _ENDERS.items():
        assert statements(methods[ender.__name__]) == STATEMENTS_OF[kind], kind
    enders = {ender.__name__ for ender in _ENDERS.values()}
    elsewhere = {name: statements(node) for name, node in methods.items()
                 if name not in enders and statements(node)}
    assert not elsewhere, elsewhere


def test_every_way_of_ending_is_reported_and_a_lease_ended_first_acknowledges_a_cancel():
    """Each report names its log line, but a rejection's (its own result_rejected line);
    a lease that ended before any write has its outcome, and every outcome that wrote none
    acknowledges a cancel (case F14)."""
    assert set(LEASE_ENDING_OUTCOMES) == set(LEASE_ENDINGS)
    assert set(LEASE_ENDING_OUTCOMES.values()) <= ACKNOWLEDGING_OUTCOMES
    for how, report in ENDING_REPORTS.items():
        assert report.event is not None or report.journal == "result_rejected", how
