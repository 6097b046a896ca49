"""Starting a workflow's execution under its name, against moto's Step Functions."""

from __future__ import annotations

import json

import pytest
from moto import mock_aws

from ferry import aws, errors, workflows

RUNS_UNTIL_STOPPED = json.dumps({"StartAt": "Wait", "States": {"Wait": {"Type": "Wait", "Seconds": 3600, "End": True}}})


@pytest.fixture
def machine(aws_test_credentials):
    with mock_aws():
        aws.reset()
        sfn = aws.client("stepfunctions")
        yield sfn.create_state_machine(name="ferry-test-confirm", definition=RUNS_UNTIL_STOPPED,
                                       roleArn="arn:aws:iam::123456789012:role/ferry-test")["stateMachineArn"]
        aws.reset()


def test_starting_the_same_execution_again_is_idempotent(machine):
    first = workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1"})
    again = workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1"})

    assert first == again == workflows.execution_arn(machine, "confirm-1")
    assert len(aws.client("stepfunctions").list_executions(stateMachineArn=machine)["executions"]) == 1


def test_a_name_another_requests_execution_holds_is_refused_and_nothing_is_started(machine):
    # GIVEN an execution of another request under the name this start wants
    workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1", "request_id": "req-a"})

    # WHEN this request starts its workflow under that name, THEN it is told (its caller undoes
    # what it accepted) instead of taking the other request's execution for its own
    with pytest.raises(errors.ExecutionNameTaken):
        workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1", "request_id": "req-b"})
    [execution] = aws.client("stepfunctions").list_executions(stateMachineArn=machine)["executions"]
    described = workflows.describe_execution(machine, "confirm-1")
    assert execution["name"] == "confirm-1" and json.loads(described["input"])["request_id"] == "req-a"


def test_a_name_taken_as_far_as_step_functions_can_yet_tell_is_taken_for_this_starts_own(machine, monkeypatch):
    workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1", "request_id": "req-a"})
    monkeypatch.setattr(workflows, "describe_execution", lambda *_args: None)  # not described yet

    arn = workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1", "request_id": "req-b"})

    assert arn == workflows.execution_arn(machine, "confirm-1")
