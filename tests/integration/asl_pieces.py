"""Run a piece of a real state machine with moto's ASL interpreter.

The states are taken from a definition as the template deploys it locally; every state the piece
leads to outside itself is replaced by a Succeed state of the same name, so an execution shows
which way the piece sends a document and what it carries there.
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
from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl
from moto_credentials import REGION, use_moto_credentials

from ferry.local.runtime import ScaledRetryClock
from ferry.local.template import resolve

ROOT = Path(__file__).resolve().parents[2]
ROLE_ARN = "arn:aws:iam::123456789012:role/ferry-test"


def deployed_definition(asl_file: str) -> dict[str, Any]:
    """The definition of ``statemachine/<asl_file>`` as the template deploys it locally."""
    machine = next(m for m in resolve(ROOT / "template.yaml").state_machines.values()
                   if m.definition_uri == ROOT / "statemachine" / asl_file)
    return json.loads(machine.definition())


def moto_sfn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A Step Functions client of a moto that executes definitions (for a test module's fixture)."""
    use_moto_credentials(monkeypatch)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        yield boto3.client("stepfunctions", region_name=REGION)


def moto_sfn_skipping_retry_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """:func:`moto_sfn` whose executions skip the waits between Retry attempts."""
    monkeypatch.setattr(retrier_decl, "time", ScaledRetryClock(sleep=lambda seconds: None))
    yield from moto_sfn(monkeypatch)


def run_piece(sfn: Any, kept: dict[str, Any], start: str, document: dict[str, Any]) -> tuple[list[str], Any]:
    """Run the states ``kept`` from ``start`` on ``document``; ``(the states entered, the output)``."""
    ends = {name for state in kept.values() for name in [state.get("Next"), state.get("Default"),
                                                           *(c["Next"] for c in state.get("Choices", []))]
            if name and name not in kept}
    definition = {"StartAt": start, "States": {**kept, **{name: {"Type": "Succeed"} for name in ends}}}
    described = run_to_the_end(sfn, definition, document)
    assert described["status"] == "SUCCEEDED", described
    history = sfn.get_execution_history(executionArn=described["executionArn"])["events"]
    entered = [e["stateEnteredEventDetails"]["name"] for e in history if "stateEnteredEventDetails" in e]
    return entered, json.loads(described["output"])


def run_to_the_end(sfn: Any, definition: dict[str, Any], document: dict[str, Any]) -> dict[str, Any]:
    """Run ``definition`` on ``document`` until it ends; the execution, described."""
    arn = sfn.create_state_machine(name=f"piece-{uuid.uuid4().hex[:8]}", definition=json.dumps(definition),
                                   roleArn=ROLE_ARN)["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=arn, name=str(uuid.uuid4()), input=json.dumps(document))
    for _ in range(200):
        described = sfn.describe_execution(executionArn=execution["executionArn"])
        if described["status"] != "RUNNING":
            return described
        time.sleep(0.05)
    raise AssertionError(f"the execution of {definition['StartAt']} did not end: {described}")


def failing(name: str, state: dict[str, Any], error: str) -> dict[str, Any]:
    """``state`` (the Lambda Task ``name``) failing with ``error`` at every attempt, retried and caught
    as it is; each attempt enters :func:`attempt` of ``name``."""
    kept = {key: state[key] for key in ("Retry", "Catch", "ResultPath", "Next") if key in state}
    failure = {"Type": "Fail", "Error": error, "Cause": f"{error} (injected)"}
    return {"Type": "Parallel", "Branches": [{"StartAt": attempt(name), "States": {attempt(name): failure}}], **kept}


def attempt(name: str) -> str:
    return f"{name}Attempt"


def path(entered: list[str]) -> list[str]:
    """The states an execution entered, without the attempts of failing ones."""
    return [name for name in entered if not name.endswith("Attempt")]


def answering(state: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a Lambda Task) answering ``result``."""
    return {"Type": "Pass", "Result": result, "ResultPath": state["ResultPath"], "Next": state["Next"]}
