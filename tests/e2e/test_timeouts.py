"""A destination host that goes quiet during a resize: its Task times out, the move rolls back, and when
the host comes back its late operation changes nothing.

The destination's agent holds the operation (a ``timeout`` fault: no answer, no heartbeat) until the
test disarms the fault. The Task state fails after the stack's ``HostOpHeartbeatSeconds`` (30 s
here) and the resize rolls back without the host. Then the host "comes back": its agent takes the
message again, finds that the workflow no longer waits for it, and drops it without running it.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from conftest import AGENT_REPORT_INTERVAL_SECONDS, HOST_OP_HEARTBEAT_SECONDS
from move_helpers import FLAVORS, SMALL, TINY, GiB, boot_with_digest, host_of, migrations_of, port_bindings, root_digest

from ferry import audit, config, faults, protocol

pytestmark = pytest.mark.e2e

DROPPED = "operation dropped without running: its workflow timed out or ended"


@pytest.fixture
def armed():
    yield faults.arm
    faults.disarm_all()


def destination_for(local_stack, source: str) -> str:
    """The host a resize within the source's cell goes to: the cell's other host."""
    [destination] = [h for h, c in local_stack.hosts.items() if c == local_stack.hosts[source] and h != source]
    return destination


def resize_executions(local_stack, server_id: str, since: dt.datetime) -> list[dict[str, Any]]:
    sfn = local_stack.client("stepfunctions")
    pages = sfn.get_paginator("list_executions").paginate(stateMachineArn=config.get().resize_state_machine_arn)
    return [e for page in pages for e in page["executions"] if server_id in e["name"] and e["startDate"] >= since]


def history(local_stack, execution_arn: str) -> list[dict[str, Any]]:
    pages = (
        local_stack.client("stepfunctions").get_paginator("get_execution_history").paginate(executionArn=execution_arn)
    )
    return [event for page in pages for event in page["events"]]


def dropped_by_agent(local_stack, host: str, server_id: str, operation: str) -> bool:
    """Whether ``host``'s agent logged dropping ``operation`` of the server, its workflow gone."""
    for line in local_stack.stack.agent_log(host).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (record.get("message"), record.get("operation"), record.get("instance_uuid")) == (
            DROPPED,
            operation,
            server_id,
        ):
            return True
    return False


def host_queue_settled(local_stack, host: str) -> bool:
    sqs = local_stack.client("sqs")
    url = sqs.get_queue_url(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))["QueueUrl"]
    attributes = sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return attributes["ApproximateNumberOfMessages"] == attributes["ApproximateNumberOfMessagesNotVisible"] == "0"


def assert_rolled_back(local_stack, servers, records, server: dict[str, Any], digest: str, destination: str) -> None:
    """The server as before the resize, on its source; nothing of it on the destination; its migration in error."""
    source = host_of(server)
    after = servers.wait_for_status(server["id"], "ACTIVE", timeout=30)
    assert host_of(after) == source and after["flavor"]["original_name"] == "ferry.tiny"
    assert after["OS-EXT-STS:power_state"] == 1
    assert records.allocations(server["id"]) == {records.provider(source): FLAVORS[TINY]}
    [migration] = migrations_of(server["id"], local_stack.hosts[source])
    assert migration.status == "error" and migration.dest_compute == destination
    assert not records.consumer_exists(migration.uuid)
    root = records.instance_dir(source, server["id"]) / "disk"
    assert root_digest(root, FLAVORS[TINY]["DISK_GB"] * GiB) == digest
    assert not (local_stack.instances_dir(source) / f"{server['id']}_resize").exists()
    assert not records.instance_dir(destination, server["id"]).exists()
    assert not (local_stack.instances_dir(destination) / f"{server['id']}_resize").exists()
    assert port_bindings(server["id"]) == {(source, "ACTIVE")}


@pytest.mark.parametrize("operation", [protocol.PREP_RESIZE, protocol.FINISH_RESIZE])
def test_a_destination_that_times_out_rolls_back_and_its_late_operation_changes_nothing(
    local_stack, servers, records, armed, operation
):
    server, digest = boot_with_digest(local_stack, servers, TINY)
    destination = destination_for(local_stack, host_of(server))
    armed(f"{destination}:{operation}", faults.TIMEOUT)
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)

    # WHEN the destination goes quiet on the resize
    response = servers.action(server["id"], {"resize": {"flavorRef": SMALL}})
    assert response.status_code == 202, response.text

    # THEN its Task times out after the template's heartbeat, and the move rolls back without it
    [execution] = local_stack.wait_for(
        lambda: [e for e in resize_executions(local_stack, server["id"], since) if e["status"] != "RUNNING"],
        timeout=HOST_OP_HEARTBEAT_SECONDS + 120,
    )
    assert execution["status"] == "FAILED", execution
    events = history(local_stack, execution["executionArn"])
    assert any(e["type"] == "TaskTimedOut" for e in events)
    assert_rolled_back(local_stack, servers, records, server, digest, destination)
    assert operation not in {op for op, _status in records.host_operations(destination, server["id"])}

    # WHEN the host comes back
    faults.disarm_all()

    # THEN its agent drops the late operation without running it, and nothing changes
    local_stack.wait_for(lambda: dropped_by_agent(local_stack, destination, server["id"], operation), timeout=60)
    local_stack.wait_for(lambda: host_queue_settled(local_stack, destination), timeout=30)
    assert operation not in {op for op, _status in records.host_operations(destination, server["id"])}
    executions = resize_executions(local_stack, server["id"], since)
    assert [(e["executionArn"], e["status"]) for e in executions] == [(execution["executionArn"], "FAILED")]
    assert_rolled_back(local_stack, servers, records, server, digest, destination)
    # The hosts report their guests and disks after the drop, so the audit judges them too.
    deadline = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=AGENT_REPORT_INTERVAL_SECONDS + 2)
    local_stack.wait_for(lambda: dt.datetime.now(dt.UTC) > deadline, timeout=AGENT_REPORT_INTERVAL_SECONDS + 10)
    audit.assert_consistent(grace_seconds=0)


def test_a_lambda_step_that_times_out_rolls_the_resize_back(local_stack, servers, records, armed):
    server, digest = boot_with_digest(local_stack, servers, TINY)
    destination = destination_for(local_stack, host_of(server))
    armed("FinishResizeAtDest", faults.TIMEOUT)
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)

    response = servers.action(server["id"], {"resize": {"flavorRef": SMALL}})
    assert response.status_code == 202, response.text

    [execution] = local_stack.wait_for(
        lambda: [e for e in resize_executions(local_stack, server["id"], since) if e["status"] != "RUNNING"],
        timeout=120,
    )
    assert execution["status"] == "FAILED", execution
    errors = {
        details.get("error")
        for event in history(local_stack, execution["executionArn"])
        for key, details in event.items()
        if key.endswith("EventDetails") and isinstance(details, dict)
    }
    assert faults.LAMBDA_TIMEOUT_ERROR in errors
    assert_rolled_back(local_stack, servers, records, server, digest, destination)
    audit.assert_consistent(grace_seconds=0)
