"""Starting a workflow's execution under its name, against moto's Step Functions."""

from __future__ import annotations

import json

import pytest
from botocore.exceptions import ClientError, ReadTimeoutError
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


def test_a_start_whose_answer_was_lost_but_whose_execution_runs_counts_as_started(machine, monkeypatch):
    # GIVEN a start that reaches Step Functions, whose answer is then lost (a read timeout)
    sfn = aws.client("stepfunctions")
    real_start = sfn.start_execution

    def started_then_timed_out(**kwargs):
        real_start(**kwargs)
        raise ReadTimeoutError(endpoint_url="https://states.test")

    monkeypatch.setattr(sfn, "start_execution", started_then_timed_out)

    # THEN the caller is told it started (its undo would pull the records from under the workflow)
    assert workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1"}) == \
        workflows.execution_arn(machine, "confirm-1")


def test_a_start_that_failed_before_anything_was_started_raises(machine, monkeypatch):
    sfn = aws.client("stepfunctions")

    def throttled(**_kwargs):
        raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "StartExecution")

    monkeypatch.setattr(sfn, "start_execution", throttled)

    with pytest.raises(ClientError):
        workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1"})
    assert workflows.describe_execution(machine, "confirm-1") is None


def test_a_name_taken_by_an_execution_that_cannot_be_described_is_taken_for_this_starts_own(machine, monkeypatch):
    workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1", "request_id": "req-a"})

    def denied(*_args):
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "not allowed"}}, "DescribeExecution")

    monkeypatch.setattr(workflows, "describe_execution", denied)

    arn = workflows.start_execution(machine, "confirm-1", {"migration_uuid": "m-1", "request_id": "req-b"})

    assert arn == workflows.execution_arn(machine, "confirm-1")
