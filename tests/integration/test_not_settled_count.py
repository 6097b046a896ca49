"""An execution that ends without settling what it changed is counted for the operators' alarm.

Each such Fail state is reached through a ``putMetricData`` Task of its own (``Count<state>``):
run by moto's ASL interpreter as the template deploys it, the count lands in CloudWatch with its
workflow and state, and the execution still fails with the Fail state's error; a count CloudWatch
refuses (three times) ends the execution the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from asl_pieces import ROOT, deployed_definition, moto_sfn_skipping_retry_waits, run_to_the_end
from moto_credentials import REGION

from ferry.local.template import resolve

TEMPLATE = resolve(ROOT / "template.yaml")
NAMESPACE = TEMPLATE.parameters["MetricsNamespace"]
COUNTED = [("boot", "BuildOutcomeUnknown"), ("boot", "RollbackFailed"), ("confirm_resize", "RollbackFailed"),
           ("delete", "RollbackFailed"), ("power", "RollbackFailed"), ("resize", "MoveOutcomeUnknown"),
           ("resize", "RollbackFailed"), ("revert_resize", "RollbackFailed"),
           ("volume_attachment", "VolumeOutcomeUnknown"), ("volume_attachment", "RollbackFailed"),
           ("drain", "ReportLost")]
# What the document carries when it reaches the count: the step's error (a Fail state may pass it on).
DOCUMENT = {"instance_uuid": "i", "error": {"Error": "Ferry.InjectedFault", "Cause": "the step failed"}}


@pytest.fixture
def sfn(monkeypatch) -> Iterator[Any]:
    yield from moto_sfn_skipping_retry_waits(monkeypatch)


def run_count(sfn: Any, workflow: str, fail: str, count: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run ``Count<fail>`` (or ``count`` in its place) into the real Fail state; the execution, described."""
    states = deployed_definition(f"{workflow}.asl.json")["States"]
    definition = {"StartAt": f"Count{fail}", "States": {f"Count{fail}": count or states[f"Count{fail}"],
                                                         fail: states[fail]}}
    return run_to_the_end(sfn, definition, DOCUMENT)


def counted(workflow: str, fail: str) -> float:
    """The sum of WorkflowNotSettled for the workflow's state machine and ``fail``, as CloudWatch has it."""
    machine = next(m for m in TEMPLATE.state_machines.values()
                   if m.definition_uri == ROOT / "statemachine" / f"{workflow}.asl.json")
    dimensions = [{"Name": "Workflow", "Value": machine.name.removeprefix(f"ferry-{TEMPLATE.stage}-")},
                  {"Name": "State", "Value": fail}]
    now = time.time()
    points = boto3.client("cloudwatch", region_name=REGION).get_metric_statistics(
        Namespace=NAMESPACE, MetricName="WorkflowNotSettled", Dimensions=dimensions, StartTime=now - 600,
        EndTime=now + 600, Period=60, Statistics=["Sum"])["Datapoints"]
    return sum(point["Sum"] for point in points)


def expected_error(workflow: str, fail: str) -> str:
    state = deployed_definition(f"{workflow}.asl.json")["States"][fail]
    return state.get("Error") or DOCUMENT["error"]["Error"]


@pytest.mark.parametrize(("workflow", "fail"), COUNTED, ids=[f"{w}:{f}" for w, f in COUNTED])
def test_an_execution_ending_unsettled_is_counted_and_still_fails_as_before(sfn, workflow, fail):
    described = run_count(sfn, workflow, fail)

    assert described["status"] == "FAILED" and described["error"] == expected_error(workflow, fail)
    assert counted(workflow, fail) == 1


def test_a_count_cloudwatch_refuses_still_ends_the_execution_where_it_would_have(sfn):
    # GIVEN a count that cannot be put (its datum is refused)
    count = deployed_definition("resize.asl.json")["States"]["CountRollbackFailed"]
    [datum] = count["Parameters"]["MetricData"]
    refused = {**count, "Parameters": {**count["Parameters"], "MetricData": [{**datum, "Value": "one"}]}}

    described = run_count(sfn, "resize", "RollbackFailed", refused)

    # THEN, the put tried three times, the execution fails at RollbackFailed as it would have, and
    # nothing is counted
    assert described["status"] == "FAILED" and described["error"] == "Ferry.MoveNotSettled"
    history = sfn.get_execution_history(executionArn=described["executionArn"])["events"]
    assert [e["type"] for e in history].count("TaskFailed") == 3, [e["type"] for e in history]
    assert counted("resize", "RollbackFailed") == 0
