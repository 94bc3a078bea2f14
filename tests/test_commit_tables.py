"""The one ender of an attempt (sidecar.worker.commit.FencedCommit.end): its two tables, checked
without a database or a process. The fenced writes themselves are exercised end to end
by test_ownership.py, test_lost_answers.py, test_db_faults.py and test_locks_and_settings.py."""

from __future__ import annotations

import random
import typing

import pytest
from test_docs import _catalog

from sidecar.protocol.model import LeaseProfile
from sidecar.protocol.verdict import Ending
from sidecar.worker.commit import _ENDERS, ENDING_REPORTS, How, backoff_seconds

pytestmark = pytest.mark.unit


def test_every_kind_of_ending_has_one_fenced_write():
    """Every member of the Ending union is dispatched, and nothing else is."""
    assert set(_ENDERS) == set(typing.get_args(Ending))


def test_every_way_of_ending_is_reported_by_the_one_table_and_the_catalog_knows_it():
    """Each way an attempt ends has one report; its log line and its journal row are
    events of the catalog (docs/operations.md) at that level and place."""
    assert set(ENDING_REPORTS) == set(How)
    catalog = _catalog()
    for outcome, report in ENDING_REPORTS.items():
        if report.event is not None:
            levels, place = catalog[report.event]
            assert place in ("log", "both") and report.level in levels, (outcome, report)
        if report.journal is not None:
            assert catalog[report.journal][1] in ("journal", "both"), (outcome, report)


def _profile(base: float, cap: float) -> LeaseProfile:
    fields = {f: None for f in LeaseProfile.__dataclass_fields__}
    return LeaseProfile(**{**fields, "backoff_base_seconds": base, "backoff_max_seconds": cap})


def test_backoff_is_full_jitter_under_the_capped_exponential():
    """P16: attempt n waits a uniform draw in [0, min(cap, base x 2^(n-1))] seconds."""
    random.seed(7)
    profile = _profile(0.5, 10.0)
    for attempt in range(1, 12):
        bound = min(10.0, 0.5 * 2 ** (attempt - 1))
        draws = [backoff_seconds(profile, attempt) for _ in range(200)]
        assert all(0.0 <= d <= bound for d in draws)
        assert max(draws) > 0.8 * bound  # the draw spans the range, not a fixed delay
