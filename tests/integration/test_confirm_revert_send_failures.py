"""A confirm or revert whose host operation's message SQS never took, run by moto's executor.

The host's queue URL the first step names is one that does not exist (the host's queue deleted
while a warm function still holds its URL). Step Functions then
fails the send, no message reaches the agent, and nothing on the host was touched: the server
stays in VERIFY_RESIZE and can be confirmed or reverted again, never ERROR. moto's executor fails
such a send as SQS.SdkClientException with SQS's message as the cause ("The specified queue does
not exist."); Step Functions on AWS says SQS.AmazonSQSException, which the definitions send to
the same state without looking at the cause (tests/unit/test_asl.py checks both routings).
"""

from __future__ import annotations

import time
import uuid as uuidlib
from typing import Any

import test_confirm_revert_executions as executions
from test_confirm_revert_executions import Stack, confirm, revert
from verify_resize_helpers import (
    DEST,
    NEW_USAGE,
    OLD_USAGE,
    PROJECT,
    SOURCE,
    USER,
    instance_row,
    make_resized,
    migration_row,
    usage,
)

from ferry import hosts
from ferry.compute import migration_states, moves, states

# The local stack and its fake agents, as the confirm and revert executions run on.
stack = executions.stack


def _send_to_a_queue_that_does_not_exist(host: str) -> None:
    """The URL the workflows' first step gives for ``host`` names no queue (the agent's own stays)."""
    url = hosts.queue_url(host)
    hosts._queue_urls[host] = f"{url}-deleted"


def _states_entered(stack: Stack, execution: dict[str, Any]) -> list[str]:
    events = stack.sfn.get_execution_history(executionArn=execution["executionArn"], maxResults=1000)["events"]
    return [event["stateEnteredEventDetails"]["name"] for event in events if "stateEnteredEventDetails" in event]


def _failed_tasks(stack: Stack, execution: dict[str, Any]) -> list[str]:
    events = stack.sfn.get_execution_history(executionArn=execution["executionArn"], maxResults=1000)["events"]
    return [event["taskFailedEventDetails"]["error"] for event in events if "taskFailedEventDetails" in event]


def test_a_revert_whose_message_never_reached_the_destination_leaves_verify_resize(stack):
    resized = make_resized()
    _send_to_a_queue_that_does_not_exist(DEST)

    execution = revert(resized, stack)

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.RevertResizeFailed")
    assert _failed_tasks(stack, execution) == ["SQS.SdkClientException"]
    entered = _states_entered(stack, execution)
    assert entered[-3:] == ["WasMessageSent", "RestoreVerifyResize", "RevertFailed"], entered
    assert "FailRevert" not in entered
    assert stack.agents.received == []
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.RESIZED, None, DEST)
    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, NEW_USAGE)


def test_a_confirm_whose_message_never_reached_the_source_can_still_be_reverted(stack):
    resized = make_resized()
    _send_to_a_queue_that_does_not_exist(SOURCE)

    execution = confirm(resized, stack)

    assert (execution["status"], execution.get("error")) == ("FAILED", "Ferry.ConfirmResizeFailed")
    assert _failed_tasks(stack, execution) == ["SQS.SdkClientException"]
    entered = _states_entered(stack, execution)
    assert entered[-3:] == ["WasMessageSent", "RestoreVerifyResize", "ConfirmFailed"], entered
    assert "FailConfirm" not in entered
    assert stack.agents.received == []
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.RESIZED, None, DEST)
    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, NEW_USAGE)

    # THEN the owner still has the revert: the source kept the old guest and disks
    hosts._queue_urls.clear()
    moves.begin_revert("cell1", resized.instance_uuid, request_id=f"req-{uuidlib.uuid4()}", user_id=USER,
                       project_id=PROJECT)
    deadline = time.monotonic() + 60
    while migration_row(resized.migration_uuid).status == migration_states.REVERTING and time.monotonic() < deadline:
        time.sleep(0.2)
    assert migration_row(resized.migration_uuid).status == migration_states.REVERTED
    assert instance_row(resized.instance_uuid).host == SOURCE
