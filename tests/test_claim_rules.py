"""The claim loop's rules (sidecar.worker.claim_loop.may_claim, drained) as pure functions:
fast unit tests beside the end-to-end ones (test_worker_lifecycle.py,
test_shortages_and_privileges.py, test_forwarding.py), which stay."""

from __future__ import annotations

import itertools

import pytest

from sidecar.worker.claim_loop import drained, may_claim

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("running, concurrency, stopping, pause_left", list(itertools.product(
    [0, 1, 2, 3], [1, 2, 3], [False, True], [0.0, 0.5, 30.0])))
def test_a_claim_needs_a_free_slot_no_stop_and_no_shortage_pause(
        running, concurrency, stopping, pause_left):
    assert may_claim(running, concurrency, stopping, pause_left) is (
        running < concurrency and not stopping and pause_left == 0.0)


@pytest.mark.parametrize("running, unfinished, due_outbox", list(itertools.product(
    [0, 1], [0, 1, 5], [0, 1])))
def test_a_drain_ends_only_when_nothing_runs_waits_or_is_still_to_forward(
        running, unfinished, due_outbox):
    assert drained(running, unfinished, due_outbox) is (
        running == 0 and unfinished == 0 and due_outbox == 0)
