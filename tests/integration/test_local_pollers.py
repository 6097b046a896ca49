"""SQS event sources (partial batch failures, redrive) and rate() schedules, played by the local stack."""

from __future__ import annotations

import json
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ferry.errors import LocalStackError
from ferry.local import provision, runtime, template
from ferry.local.pollers import RATE_SCALE_VARIABLE, Pollers, SqsPoller, default_rate_scale, failed_message_ids

TEMPLATE = """
Transform: AWS::Serverless-2016-10-31
Parameters:
  Stage: {Type: String, Default: local}
Resources:
  ReportsDeadLetterQueue:
    Type: AWS::SQS::Queue
    Properties: {QueueName: !Sub "pl-${Stage}-reports-dlq"}
  ReportsQueue:
    Type: AWS::SQS::Queue
    Properties:
      QueueName: !Sub "pl-${Stage}-reports"
      VisibilityTimeout: 1
      RedrivePolicy: {deadLetterTargetArn: !GetAtt ReportsDeadLetterQueue.Arn, maxReceiveCount: 2}
  PlainQueue:
    Type: AWS::SQS::Queue
    Properties: {QueueName: !Sub "pl-${Stage}-plain", VisibilityTimeout: 1}
  ReportFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "pl-${Stage}-report"
      CodeUri: functions/report/
      Handler: app.handler
      Events:
        Reports:
          Type: SQS
          Properties:
            Queue: !GetAtt ReportsQueue.Arn
            BatchSize: 10
            FunctionResponseTypes: [ReportBatchItemFailures]
  PlainFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "pl-${Stage}-plain"
      CodeUri: functions/report/
      Handler: app.handler
      Events:
        Plain:
          Type: SQS
          Properties: {Queue: !GetAtt PlainQueue.Arn, BatchSize: 10}
  BusyQueue:
    Type: AWS::SQS::Queue
    Properties: {QueueName: !Sub "pl-${Stage}-busy", VisibilityTimeout: 30}
  BusyFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "pl-${Stage}-busy"
      CodeUri: functions/busy/
      Handler: app.handler
      Events:
        Busy:
          Type: SQS
          Properties:
            Queue: !GetAtt BusyQueue.Arn
            BatchSize: 1
            ScalingConfig: {MaximumConcurrency: 3}
  TickFunction:
    Type: AWS::Serverless::Function
    Properties:
      FunctionName: !Sub "pl-${Stage}-tick"
      CodeUri: functions/tick/
      Handler: app.handler
      Events:
        EveryMinute:
          Type: Schedule
          Properties: {Schedule: rate(1 minute), Input: '{"job": "auto-confirm"}'}
"""

REPORT = """
calls = []

def handler(event, context):
    calls.append(event)
    bodies = [r["body"] for r in event["Records"]]
    if "explode" in bodies:
        raise RuntimeError("the whole batch failed")
    if "unknown-id" in bodies:
        return {"batchItemFailures": [{"itemIdentifier": "not-a-message-id"}]}
    return {"batchItemFailures": [{"itemIdentifier": r["messageId"]} for r in event["Records"]
                                  if r["body"].startswith("fail")]}
"""

# Each batch takes a while and leaves (start, end, module) in a file next to the code: every
# execution environment is its own module, so a module-level list would not see the others.
BUSY = """
import json
import time
from pathlib import Path

TRACE = Path(__file__).with_name("trace.jsonl")

def handler(event, context):
    started = time.monotonic()
    time.sleep(0.5)
    with TRACE.open("a") as trace:
        trace.write(json.dumps([started, time.monotonic(), __name__]) + "\\n")
    return {}
"""

TICK = """
calls = []

def handler(event, context):
    calls.append(event)
    return {"ran": len(calls)}
"""


@pytest.fixture
def app(tmp_path) -> Iterator[tuple[template.LocalTemplate, runtime.LocalAws]]:
    for name, code in {"report": REPORT, "tick": TICK, "busy": BUSY}.items():
        (tmp_path / "functions" / name).mkdir(parents=True)
        (tmp_path / "functions" / name / "app.py").write_text(textwrap.dedent(code))
    (tmp_path / "template.yaml").write_text(textwrap.dedent(TEMPLATE))
    port = runtime.free_port()
    model = template.resolve(Path(tmp_path / "template.yaml"), endpoint_url=f"http://127.0.0.1:{port}")
    aws = runtime.LocalAws(model, port=port).start()
    try:
        provision.provision(model, aws.client)
        yield model, aws
    finally:
        aws.stop()


def calls_of(aws: runtime.LocalAws, logical_id: str) -> list[dict[str, Any]]:
    function = aws.model.functions[logical_id]
    return aws.runner.handler(function).__globals__["calls"]


def poller_for(model: template.LocalTemplate, aws: runtime.LocalAws, function: str) -> SqsPoller:
    (source,) = [s for s in model.sqs_event_sources if s.function == function]
    return SqsPoller(source, model, aws.runner, aws.client)


def send(aws: runtime.LocalAws, queue: template.Queue, *bodies: str) -> None:
    sqs = aws.client("sqs")
    for body in bodies:
        sqs.send_message(
            QueueUrl=queue.url, MessageBody=body, MessageAttributes={"kind": {"DataType": "String", "StringValue": "t"}}
        )


def drain(aws: runtime.LocalAws, queue: template.Queue, wait: int = 2) -> list[str]:
    """Bodies of the messages visible in ``queue`` within ``wait`` seconds (deleted as read)."""
    sqs = aws.client("sqs")
    found = []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        messages = sqs.receive_message(QueueUrl=queue.url, MaxNumberOfMessages=10, WaitTimeSeconds=1).get(
            "Messages", []
        )
        for message in messages:
            found.append(message["Body"])
            sqs.delete_message(QueueUrl=queue.url, ReceiptHandle=message["ReceiptHandle"])
    return found


def wait_for(predicate: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_only_the_messages_reported_as_failed_come_back(app):
    model, aws = app
    queue = model.queues["ReportsQueue"]
    send(aws, queue, "ok-1", "fail-2", "ok-3")
    poller = poller_for(model, aws, "ReportFunction")
    handled = 0
    while handled < 3:
        handled += poller.poll_once()
    assert drain(aws, queue) == ["fail-2"]


def test_the_function_receives_an_sqs_event(app):
    model, aws = app
    queue = model.queues["ReportsQueue"]
    send(aws, queue, "ok-1")
    wait_for(lambda: poller_for(model, aws, "ReportFunction").poll_once())
    (record,) = calls_of(aws, "ReportFunction")[-1]["Records"]
    assert record["body"] == "ok-1"
    assert record["eventSource"] == "aws:sqs"
    assert record["eventSourceARN"] == queue.arn
    assert record["awsRegion"] == "us-east-1"
    assert record["attributes"]["ApproximateReceiveCount"] == "1"
    assert record["messageAttributes"]["kind"]["stringValue"] == "t"
    assert record["messageId"] and record["receiptHandle"]


def test_a_failing_function_leaves_the_whole_batch_on_the_queue(app):
    model, aws = app
    queue = model.queues["PlainQueue"]
    send(aws, queue, "ok-1", "explode")
    poller = poller_for(model, aws, "PlainFunction")
    handled = 0
    while handled < 2:
        handled += poller.poll_once()
    assert sorted(drain(aws, queue)) == ["explode", "ok-1"]


def test_without_report_batch_item_failures_a_returned_failure_list_is_ignored(app):
    model, aws = app
    queue = model.queues["PlainQueue"]
    send(aws, queue, "fail-1")
    wait_for(lambda: poller_for(model, aws, "PlainFunction").poll_once())
    assert drain(aws, queue) == []


def test_an_unknown_item_identifier_fails_the_whole_batch(app):
    model, aws = app
    queue = model.queues["ReportsQueue"]
    send(aws, queue, "unknown-id")
    wait_for(lambda: poller_for(model, aws, "ReportFunction").poll_once())
    assert drain(aws, queue) == ["unknown-id"]


def test_a_message_failing_max_receive_count_times_moves_to_the_dead_letter_queue(app):
    model, aws = app
    send(aws, model.queues["ReportsQueue"], "fail-forever")
    pollers = Pollers(model, aws.runner, aws.client, rate_scale=1000).start()
    try:
        moved = wait_for(lambda: drain(aws, model.queues["ReportsDeadLetterQueue"], wait=1), timeout=30)
    finally:
        pollers.stop()
    assert moved == ["fail-forever"]


def test_a_schedule_runs_its_function_on_the_scaled_rate_with_its_input(app):
    model, aws = app
    pollers = Pollers(model, aws.runner, aws.client, rate_scale=0.001).start()
    try:
        wait_for(lambda: len(calls_of(aws, "TickFunction")) >= 2)
    finally:
        pollers.stop()
    assert calls_of(aws, "TickFunction")[0] == {"job": "auto-confirm"}


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (None, set()),
        ({"batchItemFailures": []}, set()),
        ({"batchItemFailures": [{"itemIdentifier": "a"}]}, {"a"}),
        ({"batchItemFailures": [{"itemIdentifier": "zzz"}]}, None),
        ({"batchItemFailures": [{"itemIdentifier": ""}]}, None),
        ({"batchItemFailures": "a"}, None),
    ],
)
def test_batch_item_failures_are_read_as_lambda_reads_them(result, expected):
    assert failed_message_ids(json.loads(json.dumps(result)), {"a", "b"}) == expected


def test_a_mapping_with_maximum_concurrency_runs_that_many_batches_at_once(app):
    # GIVEN a mapping of batch size 1 with ScalingConfig.MaximumConcurrency 3, and six messages
    model, aws = app
    assert [s.maximum_concurrency for s in model.sqs_event_sources if s.function == "BusyFunction"] == [3]
    send(aws, model.queues["BusyQueue"], *(f"m{i}" for i in range(6)))
    trace = model.functions["BusyFunction"].code_dir / "trace.jsonl"

    # WHEN the event sources run
    pollers = Pollers(model, aws.runner, aws.client, rate_scale=1000).start()
    try:
        wait_for(lambda: trace.is_file() and len(trace.read_text().splitlines()) == 6)
    finally:
        pollers.stop()

    # THEN three batches ran at once, each poller in an execution environment of its own, and
    # stopping joined every poller
    batches = [json.loads(line) for line in trace.read_text().splitlines()]
    most = max(sum(1 for start, end, _ in batches if start <= moment < end) for moment, _, _ in batches)
    assert most == 3
    assert len({module for _, _, module in batches}) == 3
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("sqs-BusyFunction")]


@pytest.mark.parametrize("value", ["fast", "0", "-1", "inf", "nan"])
def test_a_rate_scale_that_is_not_a_number_above_zero_is_refused(monkeypatch, value):
    monkeypatch.setenv(RATE_SCALE_VARIABLE, value)
    with pytest.raises(LocalStackError, match=RATE_SCALE_VARIABLE):
        default_rate_scale()
