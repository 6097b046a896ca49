"""The drain iteration's choices after RecordFailure, executed by moto's ASL interpreter.

The states are the real ones of ``statemachine/drain.asl.json`` (RetryChoice and MarkConfirm);
the steps they lead to are replaced by Succeed states named after them, so an execution shows
which way a RecordFailure outcome sends the iteration and what it carries there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from asl_pieces import deployed_definition, moto_sfn, run_piece


def _definition() -> dict[str, Any]:
    """The drain state machine as the template deploys it locally."""
    return deployed_definition("drain.asl.json")


def _iteration_states() -> dict[str, Any]:
    return _definition()["States"]["MoveServers"]["ItemProcessor"]["States"]


@pytest.fixture
def sfn(monkeypatch) -> Iterator[Any]:
    yield from moto_sfn(monkeypatch)


def _run(sfn: Any, document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Run the iteration from RetryChoice on ``document``; ``(the step it went to, its input there)``."""
    states = _iteration_states()
    entered, output = run_piece(sfn, {name: states[name] for name in ("RetryChoice", "MarkConfirm")},
                                "RetryChoice", document)
    return entered[-1], output


def _iteration(outcome: dict[str, Any]) -> dict[str, Any]:
    return {"drain_uuid": "d", "instance_uuid": "i", "confirm_slot": None,
            "slot": {"action": "move", "request_id": "req-attempt-1", "confirm": True}, "outcome": outcome}


def test_an_outcome_that_asks_for_the_confirm_goes_to_prepare_confirm_marking_the_attempt(sfn):
    step, state = _run(sfn, _iteration({"retry": False, "confirm": True, "state": "moving", "error": None}))

    assert step == "PrepareConfirm"
    assert state["confirm_slot"] == "req-attempt-1"  # what RecordFailure reads next time
    assert state["slot"]["request_id"] == "req-attempt-1"


@pytest.mark.parametrize(("outcome", "step"), [
    ({"retry": True, "confirm": False, "state": "pending", "error": "x"}, "AcquireSlot"),
    ({"retry": False, "confirm": False, "state": "failed", "error": "x"}, "ServerSettled"),
    ({"retry": False, "confirm": False, "state": "done", "error": None}, "ServerSettled"),
])
def test_other_outcomes_retry_or_settle_without_marking_a_confirm(sfn, outcome, step):
    went, state = _run(sfn, _iteration(outcome))

    assert went == step
    assert state["confirm_slot"] is None


def test_every_iteration_starts_with_no_confirm_marked():
    selector = _definition()["States"]["MoveServers"]["ItemSelector"]
    assert selector["confirm_slot"] is None
    record = _iteration_states()["RecordFailure"]["Parameters"]
    assert record["confirm_slot.$"] == "$.confirm_slot"
