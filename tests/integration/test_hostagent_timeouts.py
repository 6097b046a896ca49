"""Host operations that time out: the agent holds an operation armed with a ``timeout`` fault, and a
task whose workflow stopped waiting is never run late nor answered twice.

The agent runs in a thread against moto, as in ``test_hostagent.py`` (whose fixtures these tests use),
with state machines whose Task states time out within seconds.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_hostagent
from botocore.exceptions import ClientError
from test_hostagent import WAIT, Host, spawn_args, wait_for

from ferry import faults, handlers
from ferry.local.runtime import error_document
from hostagent import agent as agent_module
from hostagent import disks
from hostagent.driver import RUNNING

# The agent and its cloud, as test_hostagent.py sets them up.
cloud = test_hostagent.cloud
host = test_hostagent.host


@pytest.fixture
def armed(tmp_path, monkeypatch) -> Iterator[None]:
    monkeypatch.setenv(faults.ENV_VAR, str(tmp_path / "faults.json"))
    yield
    faults.disarm_all()


def operation_task(queue_url: str, heartbeat_seconds: int, timeout_seconds: int) -> dict[str, Any]:
    return {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "HeartbeatSeconds": heartbeat_seconds,
        "TimeoutSeconds": timeout_seconds,
        "Parameters": {
            "QueueUrl": queue_url,
            "MessageBody": {
                "operation.$": "$.operation",
                "operation_id.$": "$.operation_id",
                "instance_uuid.$": "$.instance_uuid",
                "args.$": "$.args",
                "task_token.$": "$$.Task.Token",
            },
        },
    }


def machine(host: Host, heartbeat_seconds: int = 1, timeout_seconds: int = 30, destroy_on_failure: bool = False) -> str:
    """A one-operation state machine whose Task times out quickly; optionally its Catch destroys the instance."""
    states: dict[str, Any] = {"HostOperation": {**operation_task(host.queue_url, heartbeat_seconds, timeout_seconds)}}
    if destroy_on_failure:
        states["HostOperation"]["Catch"] = [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.error", "Next": "Undo"}]
        states["HostOperation"]["End"] = True
        undo = operation_task(host.queue_url, 30, 60)
        undo["Parameters"]["MessageBody"] = {
            "operation": "destroy",
            "operation_id.$": "States.Format('{}:undo', $.operation_id)",
            "instance_uuid.$": "$.instance_uuid",
            "args": {},
            "task_token.$": "$$.Task.Token",
        }
        states["Undo"] = {**undo, "ResultPath": None, "Next": "Failed"}
        states["Failed"] = {"Type": "Fail", "Error": "OperationFailed"}
    else:
        states["HostOperation"]["End"] = True
    definition = {"StartAt": "HostOperation", "States": states}
    return host.sfn.create_state_machine(
        name=f"timeouts-{uuid.uuid4().hex[:12]}",
        definition=json.dumps(definition),
        roleArn="arn:aws:iam::123456789012:role/ferry-test",
    )["stateMachineArn"]


def start(host: Host, state_machine_arn: str, operation: str, instance_uuid: str, args: dict[str, Any]) -> str:
    payload = {
        "operation": operation,
        "operation_id": f"{uuid.uuid4()}:{operation}",
        "instance_uuid": instance_uuid,
        "args": args,
    }
    return host.sfn.start_execution(
        stateMachineArn=state_machine_arn, name=str(uuid.uuid4()), input=json.dumps(payload)
    )["executionArn"]


def answers(host: Host) -> list[dict[str, Any]]:
    return host.sfn.called("send_task_success") + host.sfn.called("send_task_failure")


def nothing_of(host: Host, instance_uuid: str) -> bool:
    return (
        not host.driver.guest_exists(instance_uuid)
        and not disks.instance_dir(host.instances_dir, instance_uuid).exists()
    )


def client_error(code: str, operation: str, status: int = 400) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, operation
    )


def test_an_operation_held_by_a_timeout_gets_no_answer_and_its_task_times_out(host, armed):
    state_machine = machine(host, heartbeat_seconds=1)
    instance_uuid = str(uuid.uuid4())
    faults.arm("compute1:spawn", faults.TIMEOUT)

    execution = host.finished(start(host, state_machine, "spawn", instance_uuid, spawn_args(host.image(b"x" * 4096))))

    assert execution["status"] == "FAILED" and execution["error"] == "States.Timeout", execution
    assert answers(host) == [] and host.sfn.called("send_task_heartbeat") == []
    assert nothing_of(host, instance_uuid)
    assert not host.queue_is_empty(), "the held message is still taken"


def test_a_held_operation_let_go_after_its_workflow_ended_is_dropped_without_running(host, armed):
    state_machine = machine(host, heartbeat_seconds=1)
    instance_uuid = str(uuid.uuid4())
    faults.arm("*:spawn", faults.TIMEOUT)
    execution_arn = start(host, state_machine, "spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)))
    assert host.finished(execution_arn)["status"] == "FAILED"

    faults.disarm_all()  # the host comes back

    assert wait_for(host.queue_is_empty, "the late message to be taken and dropped")
    assert answers(host) == [], "a stale answer was sent"
    assert nothing_of(host, instance_uuid)
    assert host.agent.journal is not None and host.agent.journal.in_progress() == []
    assert host.sfn.describe_execution(executionArn=execution_arn)["status"] == "FAILED"


def test_a_timeout_armed_with_hold_seconds_lets_go_by_itself(host, armed):
    state_machine = machine(host, heartbeat_seconds=1)
    instance_uuid = str(uuid.uuid4())
    faults.arm("*:spawn", faults.TIMEOUT, hold_seconds=3)

    assert (
        host.finished(start(host, state_machine, "spawn", instance_uuid, spawn_args(host.image(b"x"))))["status"]
        == "FAILED"
    )

    assert wait_for(host.queue_is_empty, "the held message to be let go and dropped")
    assert answers(host) == [] and nothing_of(host, instance_uuid)


def test_a_held_operation_does_not_block_the_operations_after_it(host, armed):
    faults.arm("*:spawn", faults.TIMEOUT)
    held = str(uuid.uuid4())
    host.start("spawn", held, spawn_args(host.image(b"x" * 4096)))

    other = str(uuid.uuid4())
    assert host.execute("destroy", other, {})["status"] == "SUCCEEDED"
    assert nothing_of(host, held)


def test_a_message_taken_after_its_task_timed_out_is_dropped_without_running(host):
    # On AWS a heartbeat for a Task that timed out answers TaskTimedOut (moto keeps such a token
    # alive until its execution ends, so the answer is forced here).
    instance_uuid = str(uuid.uuid4())

    def timed_out(_kwargs: dict[str, Any]) -> None:
        raise host.sfn.exceptions.TaskTimedOut(
            {"Error": {"Code": "TaskTimedOut", "Message": "Task Timed Out"}}, "SendTaskHeartbeat"
        )

    host.sfn.hooks["send_task_heartbeat"] = timed_out
    execution_arn = host.start("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)))

    wait_for(lambda: host.sfn.called("send_task_heartbeat"), "the agent to ask whether the task is awaited")
    assert wait_for(host.queue_is_empty, "the message to be dropped")
    assert answers(host) == [] and nothing_of(host, instance_uuid)
    assert host.driver.defined == 0
    host.sfn.stop_execution(executionArn=execution_arn)


def test_an_unsure_liveness_check_leaves_the_operation_for_the_next_delivery(host, monkeypatch):
    monkeypatch.setattr(agent_module, "UNSURE_REDELIVERY_SECONDS", 1)
    monkeypatch.setattr(agent_module, "STEP_FUNCTIONS_RETRY_SECONDS", 0.05)
    failing = threading.Event()
    failing.set()

    def internal_error(_kwargs: dict[str, Any]) -> None:
        if failing.is_set():
            raise client_error("InternalError", "SendTaskHeartbeat", 500)

    host.sfn.hooks["send_task_heartbeat"] = internal_error
    instance_uuid = str(uuid.uuid4())
    execution_arn = host.start("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)))
    wait_for(lambda: len(host.sfn.called("send_task_heartbeat")) >= agent_module.STEP_FUNCTIONS_ATTEMPTS, "asking")
    assert host.driver.defined == 0

    failing.clear()  # Step Functions answers again

    finished = host.finished(execution_arn)
    assert finished["status"] == "SUCCEEDED", finished
    assert host.driver.guest_power_state(instance_uuid) == RUNNING and host.driver.defined == 1


def failing_first(*failures: Exception) -> Callable[[dict[str, Any]], None]:
    """A client hook that raises ``failures`` one per call, then lets calls through."""
    left = iter(failures)

    def hook(_kwargs: dict[str, Any]) -> None:
        failure = next(left, None)
        if failure is not None:
            raise failure

    return hook


def test_a_transient_failure_of_the_liveness_check_is_asked_again(host, monkeypatch):
    monkeypatch.setattr(agent_module, "STEP_FUNCTIONS_RETRY_SECONDS", 0.05)
    host.sfn.hooks["send_task_heartbeat"] = failing_first(client_error("ThrottlingException", "SendTaskHeartbeat"))
    instance_uuid = str(uuid.uuid4())

    finished = host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)))

    assert finished["status"] == "SUCCEEDED", finished
    assert len(host.sfn.called("send_task_heartbeat")) >= 2 and host.driver.defined == 1
    assert len(host.sqs.called("receive_message")) >= 1


def test_an_answer_that_cannot_be_sent_comes_back_soon_and_is_answered_from_the_journal(host, monkeypatch):
    monkeypatch.setattr(agent_module, "STEP_FUNCTIONS_RETRY_SECONDS", 0.01)
    # the run's answer fails, and so does the answer from the journal when the message comes back
    throttled = [client_error("ThrottlingException", "SendTaskSuccess")] * (2 * agent_module.STEP_FUNCTIONS_ATTEMPTS)
    host.sfn.hooks["send_task_success"] = failing_first(*throttled)
    instance_uuid = str(uuid.uuid4())

    finished = host.execute("spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)))

    assert finished["status"] == "SUCCEEDED", finished
    assert [call["VisibilityTimeout"] for call in host.sqs.called("change_message_visibility")].count(
        agent_module.UNSURE_REDELIVERY_SECONDS) == 2
    assert host.driver.defined == 1  # run once, answered again from the journal


def test_a_stale_answer_is_dropped_and_changes_nothing(host):
    # The Task times out while the operation runs; its rollback (a destroy) waits for it, then cleans up.
    state_machine = machine(host, heartbeat_seconds=1, timeout_seconds=2, destroy_on_failure=True)
    instance_uuid = str(uuid.uuid4())
    host.driver.gate = threading.Event()
    host.driver.entered.clear()
    execution_arn = start(host, state_machine, "spawn", instance_uuid, spawn_args(host.image(b"x" * 4096)))
    assert host.driver.entered.wait(WAIT)

    def undo_sent() -> bool:
        history = host.sfn.get_execution_history(executionArn=execution_arn)["events"]
        return any(e.get("stateEnteredEventDetails", {}).get("name") == "Undo" for e in history)

    wait_for(undo_sent, "the Task to time out and its rollback to start")
    host.driver.gate.set()  # the late operation ends and answers a task nobody waits for

    finished = host.finished(execution_arn)
    assert finished["status"] == "FAILED" and finished["error"] == "OperationFailed", finished
    assert wait_for(host.queue_is_empty, "both messages to be settled")
    assert nothing_of(host, instance_uuid)
    history = host.sfn.get_execution_history(executionArn=execution_arn)["events"]
    [timed_out] = [e for e in history if e["type"] == "TaskTimedOut"]
    assert not any(e["type"] == "TaskSucceeded" and e["id"] < timed_out["id"] for e in history)


def test_a_stale_answer_refused_by_step_functions_is_logged_and_the_message_deleted(host):
    def invalid_token(_kwargs: dict[str, Any]) -> None:
        raise host.sfn.exceptions.InvalidToken({"Error": {"Code": "InvalidToken", "Message": "Invalid"}}, "X")

    host.sfn.hooks["send_task_success"] = invalid_token
    instance_uuid = str(uuid.uuid4())
    execution_arn = host.start("destroy", instance_uuid, {})

    wait_for(lambda: host.sfn.called("send_task_success"), "the answer")
    assert wait_for(host.queue_is_empty, "the message to be deleted")
    assert len(host.sfn.called("send_task_success")) == 1, "a refused answer is not sent again"
    host.sfn.stop_execution(executionArn=execution_arn)


def test_stopping_the_agent_gives_a_held_message_back_at_once(host, armed):
    faults.arm("*:power_off", faults.TIMEOUT)
    host.start("power_off", str(uuid.uuid4()), {})
    wait_for(lambda: fired("*:power_off"), "the operation to be held")

    host.agent.stop()
    host.thread.join(WAIT)

    assert wait_for(lambda: visible_messages(host) == 1, "the message to be visible again", timeout=5)


def fired(point: str) -> bool:
    path = faults._path()
    return path is not None and path.exists() and "fired_id" in json.loads(path.read_text()).get(point, {})


def visible_messages(host: Host) -> int:
    attributes = host.sqs.get_queue_attributes(QueueUrl=host.queue_url, AttributeNames=["ApproximateNumberOfMessages"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


# --- a Lambda step armed with a timeout ---------------------------------------------------------


class Context:
    """What Powertools reads of a Lambda context."""

    function_name = "ferry-PrepResizeAtDest"
    function_version = "$LATEST"
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:ferry-PrepResizeAtDest"
    memory_limit_in_mb = 128
    aws_request_id = "req-1"
    log_group_name = "/aws/lambda/ferry-PrepResizeAtDest"
    log_stream_name = "local"


def test_a_lambda_step_armed_with_a_timeout_fails_as_a_lambda_function_timeout(armed):
    ran = []
    handler = handlers.step_handler(lambda event: ran.append(event), "PrepResizeAtDest")
    faults.arm("PrepResizeAtDest", faults.TIMEOUT)

    with pytest.raises(faults.InjectedTimeout) as raised:
        handler({"instance_uuid": str(uuid.uuid4()), "request_id": "req-1"}, Context())

    assert error_document(raised.value)["errorType"] == "Sandbox.Timedout"
    assert ran == []
