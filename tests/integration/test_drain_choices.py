"""The drain iteration's choices after RecordFailure, executed by moto's ASL interpreter.

The states are the real ones of ``statemachine/drain.asl.json`` (RetryChoice and MarkConfirm);
the steps they lead to are replaced by Succeed states named after them, so an execution shows
which way a RecordFailure outcome sends the iteration and what it carries there.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto_credentials import REGION, use_moto_credentials

from ferry.local.template import resolve

ROOT = Path(__file__).resolve().parents[2]
ROLE_ARN = "arn:aws:iam::123456789012:role/ferry-test"


def _definition() -> dict[str, Any]:
    """The drain state machine as the template deploys it locally."""
    machine = next(m for m in resolve(ROOT / "template.yaml").state_machines.values()
                   if m.definition_uri == ROOT / "statemachine" / "drain.asl.json")
    return json.loads(machine.definition())


def _iteration_states() -> dict[str, Any]:
    return _definition()["States"]["MoveServers"]["ItemProcessor"]["States"]


@pytest.fixture
def sfn(monkeypatch) -> Iterator[Any]:
    use_moto_credentials(monkeypatch)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        yield boto3.client("stepfunctions", region_name=REGION)


def _run(sfn: Any, document: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Run the iteration from RetryChoice on ``document``; ``(the step it went to, its input there)``."""
    states = _iteration_states()
    kept = {name: states[name] for name in ("RetryChoice", "MarkConfirm")}
    ends = {name for state in kept.values() for name in [state.get("Next"), state.get("Default"),
                                                           *(c["Next"] for c in state.get("Choices", []))]
            if name and name not in kept}
    definition = {"StartAt": "RetryChoice",
                  "States": {**kept, **{name: {"Type": "Succeed"} for name in ends}}}
    arn = sfn.create_state_machine(name=f"drain-choices-{uuid.uuid4().hex[:8]}", definition=json.dumps(definition),
                                   roleArn=ROLE_ARN)["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=arn, name=str(uuid.uuid4()), input=json.dumps(document))
    for _ in range(200):
        described = sfn.describe_execution(executionArn=execution["executionArn"])
        if described["status"] != "RUNNING":
            break
        time.sleep(0.05)
    assert described["status"] == "SUCCEEDED", described
    history = sfn.get_execution_history(executionArn=execution["executionArn"])["events"]
    entered = [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]
    return entered[-1], json.loads(described["output"])


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
