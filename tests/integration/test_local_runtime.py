"""moto's Step Functions executor running real handlers: Lambda tasks, callbacks, Map, nested executions."""

from __future__ import annotations

import json
import os
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ferry.local import provision, runtime, template

TEMPLATE = """
Transform: AWS::Serverless-2016-10-31
Parameters:
  Stage: {Type: String, Default: local}
  HostOpTimeoutSeconds: {Type: Number, Default: 30}
Globals:
  Function:
    Timeout: 20
    MemorySize: 256
    Environment:
      Variables:
        SHARED_SETTING: !Sub "shared-${Stage}"
Resources:
  OpsDeadLetterQueue:
    Type: AWS::SQS::Queue
    Properties: {QueueName: !Sub "rt-${Stage}-ops-dlq"}
  OpsQueue:
    Type: AWS::SQS::Queue
    Properties:
      QueueName: !Sub "rt-${Stage}-ops"
      RedrivePolicy: {deadLetterTargetArn: !GetAtt OpsDeadLetterQueue.Arn, maxReceiveCount: 2}
  Bucket:
    Type: AWS::S3::Bucket
    Properties: {BucketName: !Sub "rt-${Stage}-bucket"}
  Table:
    Type: AWS::DynamoDB::Table
    Properties:
      TableName: !Sub "rt-${Stage}-table"
      BillingMode: PAY_PER_REQUEST
      AttributeDefinitions: [{AttributeName: id, AttributeType: S}]
      KeySchema: [{AttributeName: id, KeyType: HASH}]
      TimeToLiveSpecification: {AttributeName: expiration, Enabled: true}
  Bus:
    Type: AWS::Events::EventBus
    Properties: {Name: !Sub "rt-${Stage}-bus"}
  EchoFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "rt-${Stage}-echo"
      CodeUri: functions/echo/
      Handler: app.handler
      Environment: {Variables: {OWN_SETTING: echo}}
  FailFunction:
    Type: AWS::Serverless::Function
    Properties: {FunctionName: !Sub "rt-${Stage}-fail", CodeUri: functions/fail/, Handler: app.handler}
  SlowFunction:
    Type: AWS::Serverless::Function
    Properties: {FunctionName: !Sub "rt-${Stage}-slow", CodeUri: functions/slow/, Handler: app.handler}
  TasksMachine:
    Type: AWS::Serverless::StateMachine
    Properties:
      Name: !Sub "rt-${Stage}-tasks"
      DefinitionUri: statemachine/tasks.asl.json
      DefinitionSubstitutions:
        EchoFunctionArn: !GetAtt EchoFunction.Arn
        FailFunctionArn: !GetAtt FailFunction.Arn
  CallbackMachine:
    Type: AWS::Serverless::StateMachine
    Properties:
      Name: !Sub "rt-${Stage}-callback"
      DefinitionUri: statemachine/callback.asl.json
      DefinitionSubstitutions:
        OpsQueueUrl: !Ref OpsQueue
        HostOpTimeoutSeconds: !Ref HostOpTimeoutSeconds
        HostOpHeartbeatSeconds: 2
  MapMachine:
    Type: AWS::Serverless::StateMachine
    Properties:
      Name: !Sub "rt-${Stage}-map"
      DefinitionUri: statemachine/map.asl.json
      DefinitionSubstitutions: {SlowFunctionArn: !GetAtt SlowFunction.Arn}
  ParentMachine:
    Type: AWS::Serverless::StateMachine
    Properties:
      Name: !Sub "rt-${Stage}-parent"
      DefinitionUri: statemachine/parent.asl.json
      DefinitionSubstitutions: {ChildStateMachineArn: !Ref MapMachine}
"""

FUNCTIONS = {
    "echo": """
        import os

        def handler(event, context):
            return {
                "event": event,
                "function_name": context.function_name,
                "invoked_function_arn": context.invoked_function_arn,
                "memory_limit_in_mb": context.memory_limit_in_mb,
                "request_id": context.aws_request_id,
                "remaining_ms": context.get_remaining_time_in_millis(),
                "shared": os.environ.get("SHARED_SETTING"),
                "own": os.environ.get("OWN_SETTING"),
            }
    """,
    "fail": """
        from ferry import errors

        def handler(event, context):
            if event.get("plain"):
                raise ValueError("not a Ferry error")
            raise errors.NoValidHost("No valid host was found for the test.")
    """,
    "slow": """
        import threading
        import time

        _lock = threading.Lock()
        running = {"now": 0, "peak": 0}

        def handler(event, context):
            with _lock:
                running["now"] += 1
                running["peak"] = max(running["peak"], running["now"])
            time.sleep(0.2)
            with _lock:
                running["now"] -= 1
            if event.get("fail"):
                from ferry import errors
                raise errors.HypervisorError("the hypervisor refused")
            return {"item": event["i"], "peak": running["peak"]}
    """,
}

DEFINITIONS = {
    "tasks": {
        "StartAt": "Direct",
        "States": {
            "Direct": {"Type": "Task", "Resource": "${EchoFunctionArn}", "ResultPath": "$.direct", "Next": "Invoke"},
            "Invoke": {
                "Type": "Task",
                "Resource": "arn:aws:states:::lambda:invoke",
                "Parameters": {"FunctionName": "${EchoFunctionArn}", "Payload": {"via": "lambda:invoke"}},
                "ResultSelector": {"payload.$": "$.Payload"},
                "ResultPath": "$.invoke",
                "Next": "Fail",
            },
            "Fail": {
                "Type": "Task",
                "Resource": "${FailFunctionArn}",
                "Parameters": {"plain.$": "$.plain"},
                "ResultPath": "$.unreachable",
                "Catch": [{"ErrorEquals": ["Ferry.NoValidHost"], "ResultPath": "$.caught", "Next": "Rollback"}],
                "End": True,
            },
            "Rollback": {"Type": "Pass", "Result": "rolled back", "ResultPath": "$.rollback", "End": True},
        },
    },
    "callback": {
        "StartAt": "HostOp",
        "States": {
            "HostOp": {
                "Type": "Task",
                "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
                "Parameters": {
                    "QueueUrl": "${OpsQueueUrl}",
                    "MessageBody": {"input.$": "$", "task_token.$": "$$.Task.Token"},
                },
                "TimeoutSeconds": "__TIMEOUT__",
                "HeartbeatSeconds": "__HEARTBEAT__",
                "ResultPath": "$.result",
                "Retry": [{"ErrorEquals": ["Ferry.HypervisorError"], "IntervalSeconds": 1, "MaxAttempts": 1}],
                "Catch": [
                    {"ErrorEquals": ["Ferry.DiskCopyFailed"], "ResultPath": "$.error", "Next": "Rollback"},
                    {"ErrorEquals": ["States.Timeout"], "ResultPath": "$.error", "Next": "TimedOut"},
                ],
                "End": True,
            },
            "Rollback": {"Type": "Pass", "End": True},
            # The rollback after a timeout takes a while: a late answer arrives while the execution runs.
            "TimedOut": {"Type": "Wait", "Seconds": 2, "End": True},
        },
    },
    "map": {
        "StartAt": "Each",
        "States": {
            "Each": {
                "Type": "Map",
                "ItemsPath": "$.items",
                "MaxConcurrency": 2,
                "Iterator": {
                    "StartAt": "Work",
                    "States": {"Work": {"Type": "Task", "Resource": "${SlowFunctionArn}", "End": True}},
                },
                "End": True,
            }
        },
    },
    "parent": {
        "StartAt": "Child",
        "States": {
            "Child": {
                "Type": "Task",
                "Resource": "arn:aws:states:::states:startExecution.sync:2",
                "Parameters": {
                    "StateMachineArn": "${ChildStateMachineArn}",
                    "Input.$": "$",
                    "Name.$": "States.Format('{}-child', $$.Execution.Name)",
                },
                "ResultSelector": {"status.$": "$.Status", "output.$": "$.Output"},
                "Catch": [{"ErrorEquals": ["States.TaskFailed"], "ResultPath": "$.error", "Next": "ChildFailed"}],
                "End": True,
            },
            "ChildFailed": {"Type": "Pass", "End": True},
        },
    },
}


def write_app(root: Path) -> Path:
    """Write the test template, its functions and its state machines under ``root``."""
    for name, code in FUNCTIONS.items():
        (root / "functions" / name).mkdir(parents=True)
        (root / "functions" / name / "app.py").write_text(textwrap.dedent(code))
    (root / "statemachine").mkdir()
    for name, definition in DEFINITIONS.items():
        text = json.dumps(definition, indent=2)
        # Numbers substituted into the ASL text, as Ferry's state machines do.
        text = text.replace('"__TIMEOUT__"', "${HostOpTimeoutSeconds}").replace(
            '"__HEARTBEAT__"', "${HostOpHeartbeatSeconds}"
        )
        (root / "statemachine" / f"{name}.asl.json").write_text(text)
    (root / "template.yaml").write_text(textwrap.dedent(TEMPLATE))
    return root / "template.yaml"


class Running:
    def __init__(self, model: template.LocalTemplate, aws: runtime.LocalAws) -> None:
        self.model = model
        self.aws = aws
        self.sfn = aws.client("stepfunctions")
        self.sqs = aws.client("sqs")

    def start(self, machine: str, document: dict[str, Any]) -> str:
        arn = self.model.state_machines[machine].arn
        return self.sfn.start_execution(stateMachineArn=arn, name=str(uuid.uuid4()), input=json.dumps(document))[
            "executionArn"
        ]

    def finish(self, execution_arn: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            described = self.sfn.describe_execution(executionArn=execution_arn)
            if described["status"] != "RUNNING":
                return described
            assert time.monotonic() < deadline, f"{execution_arn} still running"
            time.sleep(0.05)

    def run(self, machine: str, document: dict[str, Any]) -> dict[str, Any]:
        described = self.finish(self.start(machine, document))
        assert described["status"] == "SUCCEEDED", described
        return json.loads(described["output"])

    def receive_operation(self) -> tuple[dict[str, Any], str]:
        url = self.model.queues["OpsQueue"].url
        for _ in range(20):
            messages = self.sqs.receive_message(QueueUrl=url, WaitTimeSeconds=1).get("Messages") or []
            if messages:
                self.sqs.delete_message(QueueUrl=url, ReceiptHandle=messages[0]["ReceiptHandle"])
                return json.loads(messages[0]["Body"]), messages[0]["ReceiptHandle"]
        raise AssertionError("no operation message arrived")


@pytest.fixture
def app(tmp_path) -> Iterator[Running]:
    path = write_app(tmp_path)
    port = runtime.free_port()
    model = template.resolve(path, endpoint_url=f"http://127.0.0.1:{port}", parameters={"HostOpTimeoutSeconds": 5})
    aws = runtime.LocalAws(model, port=port).start()
    try:
        provision.provision(model, aws.client)
        yield Running(model, aws)
    finally:
        aws.stop()


def test_a_task_with_a_function_arn_runs_the_real_handler(app):
    output = app.run("TasksMachine", {"plain": False})
    direct = output["direct"]
    echo = app.model.functions["EchoFunction"]
    assert direct["event"] == {"plain": False}
    assert direct["function_name"] == echo.name
    assert direct["invoked_function_arn"] == echo.arn
    assert direct["memory_limit_in_mb"] == 256
    assert 0 < direct["remaining_ms"] <= 20_000
    uuid.UUID(direct["request_id"])


def test_lambda_invoke_integration_runs_the_real_handler(app):
    output = app.run("TasksMachine", {"plain": False})
    assert output["invoke"]["payload"]["event"] == {"via": "lambda:invoke"}
    assert output["invoke"]["payload"]["function_name"] == app.model.functions["EchoFunction"].name


def test_handlers_see_the_global_and_their_own_environment(app):
    output = app.run("TasksMachine", {"plain": False})
    assert output["direct"]["shared"] == "shared-local"
    assert output["direct"]["own"] == "echo"


def test_a_typed_error_is_caught_by_its_ferry_name(app):
    output = app.run("TasksMachine", {"plain": False})
    assert output["caught"]["Error"] == "Ferry.NoValidHost"
    cause = json.loads(output["caught"]["Cause"])
    assert cause["errorType"] == "Ferry.NoValidHost"
    assert cause["errorMessage"] == "No valid host was found for the test."
    assert output["rollback"] == "rolled back"


def test_an_error_no_catch_matches_fails_the_execution(app):
    described = app.finish(app.start("TasksMachine", {"plain": True}))
    assert described["status"] == "FAILED"
    assert described["error"] == "ValueError"


def test_invoking_through_the_lambda_api_returns_the_function_error(app):
    client = app.aws.client("lambda")
    response = client.invoke(FunctionName=app.model.functions["FailFunction"].name, Payload=b"{}")
    assert response["FunctionError"] == "Unhandled"
    assert json.loads(response["Payload"].read())["errorType"] == "Ferry.NoValidHost"
    ok = client.invoke(FunctionName=app.model.functions["EchoFunction"].arn, Payload=json.dumps({"a": 1}))
    assert "FunctionError" not in ok
    assert json.loads(ok["Payload"].read())["event"] == {"a": 1}


def test_wait_for_task_token_succeeds_with_the_sent_output(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-1"})
    body, _ = app.receive_operation()
    assert body["input"] == {"instance_uuid": "i-1"}
    app.sfn.send_task_success(taskToken=body["task_token"], output=json.dumps({"power_state": 1}))
    described = app.finish(execution)
    assert json.loads(described["output"])["result"] == {"power_state": 1}


def test_wait_for_task_token_failure_reaches_the_catch_with_its_cause(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-2"})
    body, _ = app.receive_operation()
    app.sfn.send_task_failure(taskToken=body["task_token"], error="Ferry.DiskCopyFailed", cause="checksum mismatch")
    output = json.loads(app.finish(execution)["output"])
    assert output["error"] == {"Error": "Ferry.DiskCopyFailed", "Cause": "checksum mismatch"}


def test_a_bogus_task_token_is_refused(app):
    with pytest.raises(app.sfn.exceptions.InvalidToken):
        app.sfn.send_task_success(taskToken="not-a-token", output="{}")


def test_a_host_op_without_heartbeats_times_out(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-3"})
    app.receive_operation()
    output = json.loads(app.finish(execution)["output"])
    assert output["error"]["Error"] == "States.Timeout"


def test_heartbeats_keep_a_host_op_alive_past_the_heartbeat_interval(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-4"})
    body, _ = app.receive_operation()
    for _ in range(3):  # 3 s of work with a heartbeat every second; HeartbeatSeconds is 2
        time.sleep(1)
        app.sfn.send_task_heartbeat(taskToken=body["task_token"])
    app.sfn.send_task_success(taskToken=body["task_token"], output=json.dumps({"done": True}))
    output = json.loads(app.finish(execution)["output"])
    assert output["result"] == {"done": True}


def test_heartbeats_do_not_extend_the_task_timeout(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-5"})
    body, _ = app.receive_operation()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.5):
            try:
                app.sfn.send_task_heartbeat(taskToken=body["task_token"])
            except app.sfn.exceptions.ClientError:
                return

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        output = json.loads(app.finish(execution)["output"])
    finally:
        stop.set()
        beater.join()
    assert output["error"]["Error"] == "States.Timeout"


def test_a_late_heartbeat_or_answer_to_a_timed_out_task_is_refused(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-6"})
    body, _ = app.receive_operation()
    time.sleep(2.5)  # past HeartbeatSeconds (2): the task timed out, its rollback waits
    assert app.sfn.describe_execution(executionArn=execution)["status"] == "RUNNING"
    with pytest.raises(app.sfn.exceptions.TaskTimedOut):
        app.sfn.send_task_heartbeat(taskToken=body["task_token"])
    with pytest.raises(app.sfn.exceptions.TaskTimedOut):
        app.sfn.send_task_success(taskToken=body["task_token"], output="{}")
    output = json.loads(app.finish(execution)["output"])
    assert output["error"]["Error"] == "States.Timeout" and "result" not in output


def test_each_retry_of_a_task_gets_its_own_token(app):
    execution = app.start("CallbackMachine", {"instance_uuid": "i-7"})
    first, _ = app.receive_operation()
    app.sfn.send_task_failure(taskToken=first["task_token"], error="Ferry.HypervisorError", cause="try again")
    second, _ = app.receive_operation()
    assert second["task_token"] != first["task_token"]
    with pytest.raises(app.sfn.exceptions.TaskTimedOut):
        app.sfn.send_task_success(taskToken=first["task_token"], output=json.dumps({"late": True}))
    app.sfn.send_task_success(taskToken=second["task_token"], output=json.dumps({"done": True}))
    assert json.loads(app.finish(execution)["output"])["result"] == {"done": True}


def test_map_runs_every_item_with_at_most_max_concurrency_at_once(app):
    output = app.run("MapMachine", {"items": [{"i": i} for i in range(6)]})
    assert [item["item"] for item in output] == list(range(6))
    assert max(item["peak"] for item in output) == 2


def test_a_nested_sync_execution_returns_the_childs_output(app):
    output = app.run("ParentMachine", {"items": [{"i": 0}, {"i": 1}]})
    assert output["status"] == "SUCCEEDED"
    assert [item["item"] for item in output["output"]] == [0, 1]


def test_a_failed_nested_execution_fails_the_parent_task(app):
    output = app.run("ParentMachine", {"items": [{"i": 0, "fail": True}]})
    assert output["error"]["Error"] == "States.TaskFailed"
    child = json.loads(output["error"]["Cause"])
    assert child["Status"] == "FAILED"
    assert child["Error"] == "Ferry.HypervisorError"


def test_provisioning_creates_every_resource_and_can_run_twice(app):
    provision.provision(app.model, app.aws.client)
    sqs = app.aws.client("sqs")
    ops = app.model.queues["OpsQueue"]
    attributes = sqs.get_queue_attributes(QueueUrl=ops.url, AttributeNames=["All"])["Attributes"]
    assert json.loads(attributes["RedrivePolicy"]) == {
        "deadLetterTargetArn": app.model.queues["OpsDeadLetterQueue"].arn,
        "maxReceiveCount": 2,
    }
    assert app.aws.client("s3").head_bucket(Bucket=app.model.buckets["Bucket"].name)
    ttl = app.aws.client("dynamodb").describe_time_to_live(TableName=app.model.tables["Table"].name)
    assert ttl["TimeToLiveDescription"]["AttributeName"] == "expiration"
    assert app.aws.client("events").describe_event_bus(Name=app.model.event_buses["Bus"].name)
    names = {f["FunctionName"] for f in app.aws.client("lambda").list_functions()["Functions"]}
    assert names == {f.name for f in app.model.functions.values()}
    machines = {m["name"] for m in app.sfn.list_state_machines()["stateMachines"]}
    assert machines == {m.name for m in app.model.state_machines.values()}


def test_the_environment_points_handlers_at_the_local_aws_and_is_restored_on_stop(tmp_path):
    path = write_app(tmp_path)
    port = runtime.free_port()
    model = template.resolve(path, endpoint_url=f"http://127.0.0.1:{port}")
    before = os.environ.get("AWS_ENDPOINT_URL")
    aws = runtime.LocalAws(model, port=port).start()
    try:
        assert os.environ["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{port}"
        assert os.environ["MOTO_PORT"] == str(port)
        assert os.environ["SHARED_SETTING"] == "shared-local"
    finally:
        aws.stop()
    assert os.environ.get("AWS_ENDPOINT_URL") == before
    assert "SHARED_SETTING" not in os.environ


def test_a_busy_port_is_reported(tmp_path):
    import socket

    path = write_app(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        model = template.resolve(path, endpoint_url=f"http://127.0.0.1:{port}")
        from ferry.errors import LocalStackError

        with pytest.raises(LocalStackError):
            runtime.LocalAws(model, port=port).start()


def test_the_runner_reports_an_exception_as_lambda_does(tmp_path):
    path = write_app(tmp_path)
    runner = runtime.FunctionRunner(template.resolve(path))
    invocation = runner.invoke("FailFunction", {})
    assert invocation.failed
    assert invocation.error["errorType"] == "Ferry.NoValidHost"
    assert any("functions/fail/app.py" in line for line in invocation.error["stackTrace"])
    assert not any("ferry/local/runtime.py" in line for line in invocation.error["stackTrace"])


def test_a_result_that_is_not_json_is_a_marshal_error(tmp_path):
    path = write_app(tmp_path)
    (tmp_path / "functions/echo/app.py").write_text("def handler(event, context):\n    return {1, 2}\n")
    invocation = runtime.FunctionRunner(template.resolve(path)).invoke("EchoFunction", {})
    assert invocation.error["errorType"] == "Runtime.MarshalError"


def test_retry_waits_last_the_retry_scale_times_as_long(app, monkeypatch):
    from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl

    waited: list[float] = []
    clock = runtime.ScaledRetryClock(sleep=waited.append)
    clock.sleep(4)
    monkeypatch.setenv(runtime.RETRY_SCALE_ENV, "0.25")
    clock.sleep(4)

    assert waited == [4, 1]
    assert clock.monotonic() <= time.monotonic(), "the rest of the time module is the real one"
    # moto's Retry evaluation waits on such a clock while the stack runs, and on the real one after
    assert isinstance(retrier_decl.time, runtime.ScaledRetryClock)
    app.aws.stop()
    assert retrier_decl.time is time


@pytest.mark.parametrize("value", ["fast", "-1", "inf", "nan"])
def test_a_retry_scale_that_is_not_a_number_at_least_zero_stops_the_start(tmp_path, monkeypatch, value):
    from ferry.errors import LocalStackError

    monkeypatch.setenv(runtime.RETRY_SCALE_ENV, value)
    model = template.resolve(write_app(tmp_path), endpoint_url=f"http://127.0.0.1:{runtime.free_port()}")
    aws = runtime.LocalAws(model, port=0)

    with pytest.raises(LocalStackError, match=runtime.RETRY_SCALE_ENV):
        aws.start()
    aws.stop()  # nothing to stop: it failed before starting anything
