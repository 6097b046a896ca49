"""Deleting a server in VERIFY_RESIZE: the delete workflow confirms first (SQLite and PostgreSQL).

The steps run the way ``statemachine/delete.asl.json`` does: FindResizeToConfirm →
ConfirmAtSource (host agent) → ConfirmBeforeDelete → DestroyAtHost (host agent) → FinishDelete.
"""

from __future__ import annotations

import pytest
from verify_resize_helpers import (
    CELL,
    DEST,
    SOURCE,
    accept_delete,
    attachments,
    bindings,
    events,
    faults,
    host_down,
    instance_row,
    make_resized,
    migration_row,
    mocked_aws,
    set_instance,
    set_migration,
    usage,
    volume_status,
)

from ferry import notifications, placement
from ferry.compute import migration_states, states
from ferry.observability import metrics
from ferry.workflows import confirm_resize, delete


@pytest.fixture
def cloud(store, monkeypatch):
    with mocked_aws(monkeypatch) as tap:
        yield tap


def deleting(resized, request_id: str = "req-delete") -> dict:
    """What the compute API's delete writes and starts the workflow with (dest host up)."""
    accept_delete(resized.instance_uuid, request_id)
    return {"instance_uuid": resized.instance_uuid, "request_id": request_id, "cell": CELL, "host": resized.dest,
            "queue_url": "unused", "execution_name": f"delete-{resized.instance_uuid}"}


def test_delete_while_resized_confirms_first_and_leaves_nothing(cloud, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    event = deleting(resized)

    found = delete.find_resize_to_confirm(event)
    assert found == {"migration_uuid": resized.migration_uuid, "host": SOURCE, "same_host": False,
                     "queue_url": found["queue_url"], "event": "compute_confirm_resize"}
    assert found["queue_url"].endswith(SOURCE)
    event["confirm"] = found
    delete.confirm_before_delete(event)
    delete.confirm_before_delete(event)  # delivered twice
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    assert usage(SOURCE) == {}
    assert bindings(resized.instance_uuid) == {DEST: "ACTIVE"}
    delete.finish_delete(event)

    assert placement.get_allocations(resized.migration_uuid) == {}
    assert placement.get_allocations(resized.instance_uuid) == {}
    assert (usage(SOURCE), usage(DEST)) == ({}, {})
    assert bindings(resized.instance_uuid) == {}
    assert attachments(resized.instance_uuid) == {}
    assert resized.volume_id and volume_status(resized.volume_id) == "available"
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.deleted) == (states.DELETED, True)
    assert events(resized.instance_uuid) == {confirm_resize.EVENT_CONFIRM: "Success",
                                             delete.EVENT_TERMINATE: "Success"}
    assert [t for t, _ in cloud.event_types()] == [notifications.RESIZE_CONFIRM_START,
                                                   notifications.RESIZE_CONFIRM_END]


def test_a_server_without_a_resize_to_settle_is_deleted_as_before(cloud):
    resized = make_resized()
    set_migration(resized.migration_uuid, status=migration_states.REVERTED)

    assert delete.find_resize_to_confirm(deleting(resized)) == {}


def test_a_confirm_left_in_error_with_its_allocation_is_settled_by_the_delete(cloud):
    resized = make_resized()
    set_migration(resized.migration_uuid, status=migration_states.ERROR)
    set_instance(resized.instance_uuid, vm_state=states.ACTIVE)
    event = deleting(resized)

    event["confirm"] = delete.find_resize_to_confirm(event)
    delete.confirm_before_delete(event)

    assert placement.get_allocations(resized.migration_uuid) == {}
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR


def test_a_down_source_host_is_skipped_and_the_allocation_still_released(cloud):
    resized = make_resized()
    host_down(SOURCE)
    event = deleting(resized)

    event["confirm"] = delete.find_resize_to_confirm(event)
    assert event["confirm"]["queue_url"] is None
    delete.confirm_before_delete(event)

    assert usage(SOURCE) == {}
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED


def test_a_failed_confirm_before_the_delete_is_error_naming_the_source_and_can_be_retried(cloud):
    resized = make_resized()
    event = deleting(resized)
    event["confirm"] = delete.find_resize_to_confirm(event)

    delete.fail_delete({**event, "confirm_error": {"Error": "States.Timeout", "Cause": ""}})

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.ERROR, None)
    [fault] = faults(resized.instance_uuid)
    assert fault.host == SOURCE and SOURCE in fault.details and "Delete the server again" in fault.details
    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED
    assert placement.get_allocations(resized.migration_uuid) != {}
    assert events(resized.instance_uuid)[confirm_resize.EVENT_CONFIRM] == "Error"
    retry = deleting(resized, "req-delete-again")
    assert delete.find_resize_to_confirm(retry)["migration_uuid"] == resized.migration_uuid


def test_a_failed_delete_counts_the_server_left_in_error_once(cloud, monkeypatch):
    counted: list[str] = []
    monkeypatch.setattr(metrics, "add_metric", lambda **metric: counted.append(metric["name"]))
    resized = make_resized()
    event = deleting(resized)
    event["confirm"] = delete.find_resize_to_confirm(event)
    failed = {**event, "confirm_error": {"Error": "States.Timeout", "Cause": ""}}

    delete.fail_delete(failed)
    delete.fail_delete(failed)  # run again: the task is cleared, nothing more happens

    assert instance_row(resized.instance_uuid).vm_state == states.ERROR
    assert counted.count("ServerLeftInError") == 1
