"""The revert workflow's steps against a real store (SQLite and PostgreSQL).

Each test starts from a server in VERIFY_RESIZE written into the store, accepts the revert
through the compute API's own code, and drives the steps the way
``statemachine/revert_resize.asl.json`` does, with what the host agent would answer.
"""

from __future__ import annotations

import uuid as uuidlib

import jsonschema
import pytest
from sqlalchemy import delete, select
from verify_resize_helpers import (
    CELL,
    DEST,
    NEW_USAGE,
    OLD,
    OLD_USAGE,
    PROJECT,
    SOURCE,
    USER,
    attachments,
    begin,
    bindings,
    events,
    faults,
    host_down,
    host_result,
    instance_row,
    make_resized,
    migration_row,
    mocked_aws,
    provider,
    snapshot,
    usage,
)

from ferry import config, errors, notifications, placement, protocol
from ferry.compute import api as compute_api
from ferry.compute import migration_states, states
from ferry.observability import metrics
from ferry.store.api_models import Flavor, VolumeAttachment
from ferry.store.db import api_session
from ferry.workflows import confirm_resize, revert_resize


@pytest.fixture
def cloud(store, monkeypatch):
    with mocked_aws(monkeypatch) as tap:
        yield tap


def checked(event: dict) -> dict:
    return {**event, "move": revert_resize.check_resize_to_revert(event)}


def reverted_at_dest(event: dict) -> dict:
    return {**event, "reverted_at_dest": host_result(event["move"]["dest"]["host"], event["instance_uuid"])}


def moved_back(event: dict) -> dict:
    return {**event, "restore": revert_resize.revert_resources_to_source(event)}


def restored(event: dict, power_state: int) -> dict:
    return {**event, "restored": host_result(event["move"]["source"]["host"], event["instance_uuid"], power_state)}


def test_revert_leaves_the_old_flavor_on_the_source_only(cloud, monkeypatch, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    event = checked(begin("revert", resized, monkeypatch))
    move = event["move"]
    assert (move["source"]["host"], move["dest"]["host"], move["same_host"]) == (SOURCE, DEST, False)
    assert move["transfer"] == {"bucket": config.get().image_bucket, "prefix": f"transfers/{resized.migration_uuid}"}
    jsonschema.validate({"migration_uuid": resized.migration_uuid, "same_host": False, "transfer": move["transfer"]},
                        protocol.ARGS_SCHEMAS[protocol.REVERT_RESIZE])

    event = moved_back(reverted_at_dest(event))
    again = revert_resize.revert_resources_to_source(event)  # delivered twice: the same end state
    args = event["restore"]["finish_args"]
    assert again == event["restore"]
    jsonschema.validate(args, protocol.ARGS_SCHEMAS[protocol.FINISH_REVERT_RESIZE])
    assert args["flavor"] == {k: OLD[k] for k in protocol.FLAVOR_SCHEMA["required"]}
    assert args["power_on"] is True
    assert args["ports"] == [{"id": resized.port_id, "mac_address": args["ports"][0]["mac_address"]}]
    assert [(v["volume_id"], v["device"]) for v in args["volumes"]] == [(resized.volume_id, "vdd")]
    revert_resize.finish_revert(restored(event, states.RUNNING))
    revert_resize.finish_revert(restored(event, states.RUNNING))

    assert usage(SOURCE) == OLD_USAGE
    assert usage(DEST) == {}
    assert placement.get_allocations(resized.migration_uuid) == {}
    assert migration_row(resized.migration_uuid).status == migration_states.REVERTED
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.power_state, row.host, row.node, row.flavor) == (
        states.ACTIVE, None, states.RUNNING, SOURCE, SOURCE, OLD)
    assert (row.old_flavor, row.new_flavor, row.old_vm_state) == (None, None, None)
    assert bindings(resized.instance_uuid) == {SOURCE: "ACTIVE"}
    assert attachments(resized.instance_uuid) == {SOURCE: "attached"}
    assert events(resized.instance_uuid) == {revert_resize.EVENT_REVERT: "Success",
                                             revert_resize.EVENT_FINISH_REVERT: "Success"}
    assert cloud.event_types() == [(notifications.RESIZE_REVERT_START, f"compute:{DEST}"),
                                   (notifications.RESIZE_REVERT_END, f"compute:{SOURCE}")]


def test_revert_leaves_a_volume_another_server_holds_to_it(cloud, monkeypatch, tmp_path):
    # GIVEN a resized server whose mapping outlived its volume's detach (the detach's cell part never
    # committed), the volume attached to another server since
    resized = make_resized(volume=True, state_dir=tmp_path)
    other = str(uuidlib.uuid4())
    with api_session() as session:
        session.execute(delete(VolumeAttachment).where(VolumeAttachment.volume_id == resized.volume_id))
        session.add(VolumeAttachment(volume_id=resized.volume_id, instance_uuid=other, host="cell1-host3",
                                     device="vdd", status="attached"))

    # WHEN the server is reverted (its step delivered twice)
    event = reverted_at_dest(checked(begin("revert", resized, monkeypatch)))
    first = revert_resize.revert_resources_to_source(event)
    assert revert_resize.revert_resources_to_source(event) == first

    # THEN the volume stays the other server's alone, and the source does not define it in its guest
    with api_session() as session:
        holders = [a.instance_uuid for a in session.scalars(
            select(VolumeAttachment).where(VolumeAttachment.volume_id == resized.volume_id))]
    assert holders == [other]
    assert first["finish_args"]["volumes"] == []


def test_revert_after_the_old_flavor_was_deleted(cloud, monkeypatch):
    compute_api.create_flavor(name=OLD["name"], vcpus=OLD["vcpus"], memory_mb=OLD["memory_mb"],
                              root_gb=OLD["root_gb"], flavorid=OLD["flavorid"])
    resized = make_resized()
    with api_session() as session:
        session.execute(delete(Flavor).where(Flavor.flavorid == OLD["flavorid"]))

    event = moved_back(reverted_at_dest(checked(begin("revert", resized, monkeypatch))))
    revert_resize.finish_revert(restored(event, states.RUNNING))

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.host, row.flavor) == (states.ACTIVE, SOURCE, OLD)
    assert usage(SOURCE) == OLD_USAGE


def test_a_stopped_server_stays_shutoff_after_revert(cloud, monkeypatch):
    resized = make_resized(old_vm_state=states.STOPPED)
    event = moved_back(reverted_at_dest(checked(begin("revert", resized, monkeypatch))))
    assert event["restore"]["finish_args"]["power_on"] is False

    revert_resize.finish_revert(restored(event, states.SHUTDOWN))

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.power_state, states.api_status(row.vm_state, row.task_state)) == (
        states.STOPPED, states.SHUTDOWN, "SHUTOFF")


def test_a_same_host_revert_ends_with_the_old_flavor_alone_on_the_host(cloud, monkeypatch):
    resized = make_resized(source=SOURCE, dest=SOURCE)
    event = checked(begin("revert", resized, monkeypatch))
    assert event["move"]["same_host"] is True

    event = moved_back(reverted_at_dest(event))
    revert_resize.revert_resources_to_source(event)  # delivered twice: the allocation given back stays
    revert_resize.finish_revert(restored(event, states.RUNNING))

    assert placement.get_allocations(resized.instance_uuid) == {provider(SOURCE): OLD_USAGE}
    assert usage(SOURCE) == OLD_USAGE
    assert bindings(resized.instance_uuid) == {SOURCE: "ACTIVE"}
    assert instance_row(resized.instance_uuid).flavor == OLD


@pytest.mark.parametrize("dest", [DEST, SOURCE], ids=["other-host", "same-host"])
def test_a_server_without_allocations_keeps_no_destination_claim_after_revert(cloud, monkeypatch, dest):
    # GIVEN a server in VERIFY_RESIZE whose source allocation, held by the migration, an operator
    # removed through placement; another server uses both hosts
    resized = make_resized(dest=dest)
    placement.delete_allocations(resized.migration_uuid)
    neighbour = str(uuidlib.uuid4())
    placement.claim(neighbour, PROJECT, USER, {provider(SOURCE): OLD_USAGE, provider(DEST): OLD_USAGE})
    event = reverted_at_dest(checked(begin("revert", resized, monkeypatch)))

    # WHEN the revert moves the resources back, delivered twice as Step Functions may
    event = moved_back(event)
    assert revert_resize.revert_resources_to_source(event) == event["restore"]
    revert_resize.finish_revert(restored(event, states.RUNNING))

    # THEN there was nothing to give back, and the destination claim is gone too: the server holds
    # nothing, as the operator left it, and the other server's allocations are untouched
    assert placement.get_allocations(resized.instance_uuid) == {}
    assert placement.get_allocations(resized.migration_uuid) == {}
    assert placement.get_allocations(neighbour) == {provider(SOURCE): OLD_USAGE, provider(DEST): OLD_USAGE}
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, OLD_USAGE)
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.flavor) == (states.ACTIVE, None, SOURCE, OLD)
    assert migration_row(resized.migration_uuid).status == migration_states.REVERTED


@pytest.mark.parametrize("dest", [DEST, SOURCE], ids=["other-host", "same-host"])
def test_a_revert_delivered_again_keeps_the_allocation_an_operator_gave_back_meanwhile(cloud, monkeypatch, dest):
    # GIVEN a server in VERIFY_RESIZE whose migration's allocation an operator removed, and a revert that
    # dropped its destination allocation
    resized = make_resized(dest=dest)
    placement.delete_allocations(resized.migration_uuid)
    event = moved_back(reverted_at_dest(checked(begin("revert", resized, monkeypatch))))
    assert placement.get_allocations(resized.instance_uuid) == {}
    # and the operator giving the server its allocation on the source back (as `ferry audit` advises): a new
    # consumer, so at the generation the destination allocation had
    given_back = {provider(SOURCE): OLD_USAGE}
    placement.claim(resized.instance_uuid, PROJECT, USER, given_back)
    assert placement.consumer_generation(resized.instance_uuid) == event["move"]["claim_generation"]

    # WHEN RevertResourcesToSource is delivered again
    revert_resize.revert_resources_to_source(event)

    # THEN the allocation is not the one CheckResizeToRevert read: it stays
    assert placement.get_allocations(resized.instance_uuid) == given_back
    assert usage(SOURCE) == OLD_USAGE


@pytest.mark.parametrize("dest", [DEST, SOURCE], ids=["other-host", "same-host"])
def test_a_revert_keeps_the_allocation_an_operator_set_while_the_server_was_resized(cloud, monkeypatch, dest):
    # GIVEN a server in VERIFY_RESIZE whose migration holds nothing, and an operator setting its allocation on
    # the source (the old flavor, as `ferry audit` advises) in place of the destination claim before the revert
    resized = make_resized(dest=dest)
    placement.delete_allocations(resized.migration_uuid)
    given_back = {provider(SOURCE): OLD_USAGE}
    placement.claim(resized.instance_uuid, PROJECT, USER, given_back)

    # WHEN the server is reverted, RevertResourcesToSource delivered twice
    event = moved_back(reverted_at_dest(checked(begin("revert", resized, monkeypatch))))
    revert_resize.revert_resources_to_source(event)
    revert_resize.finish_revert(restored(event, states.RUNNING))

    # THEN what the server held was not the move's claim: CheckResizeToRevert did not record it, and it stays
    assert (event["move"]["claimed"], event["move"]["claim_generation"]) == ({}, None)
    assert placement.get_allocations(resized.instance_uuid) == given_back
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, {})


def test_a_revert_nobody_asked_for_is_refused_and_changes_nothing(cloud, monkeypatch):
    resized = make_resized()
    before = snapshot(resized)
    event = {"instance_uuid": resized.instance_uuid, "migration_uuid": resized.migration_uuid, "cell": CELL,
             "request_id": "req-by-hand"}

    with pytest.raises(errors.UnexpectedMigrationState):
        revert_resize.check_resize_to_revert(event)
    with pytest.raises(errors.InvalidWorkflowInput):
        revert_resize.check_resize_to_revert({**event, "cell": ""})

    assert snapshot(resized) == before


def test_a_destination_that_cannot_clean_up_leaves_verify_resize_and_a_finished_migration(cloud, monkeypatch):
    resized = make_resized()
    event = checked(begin("revert", resized, monkeypatch))

    confirm_resize.restore_verify_resize({**event, "error": {"Error": "Ferry.HypervisorError",
                                                             "Cause": "device busy"}})

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.RESIZED, None, DEST)
    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED
    assert (usage(SOURCE), usage(DEST)) == (OLD_USAGE, NEW_USAGE)
    assert bindings(resized.instance_uuid) == {DEST: "ACTIVE", SOURCE: "INACTIVE"}
    [fault] = faults(resized.instance_uuid)
    assert fault.message == "Reverting the resize failed on the destination host: Ferry.HypervisorError"
    assert fault.details.endswith("Cause: device busy")  # the host's words are the admin's
    assert DEST not in fault.message and DEST in fault.details and "Revert again" in fault.details
    assert events(resized.instance_uuid) == {revert_resize.EVENT_REVERT: "Error"}
    begin("revert", resized, monkeypatch)  # retryable
    assert instance_row(resized.instance_uuid).task_state == states.RESIZE_REVERTING


def test_a_destination_step_that_timed_out_leaves_error_never_verify_resize(cloud, monkeypatch):
    # GIVEN the destination's revert_resize timed out (its agent may have destroyed the guest
    # before it stopped answering): RevertAtDest's Catch goes to FailRevert, not RestoreVerifyResize
    resized = make_resized()
    event = checked(begin("revert", resized, monkeypatch))

    revert_resize.fail_revert({**event, "error": {"Error": "States.Timeout", "Cause": ""}})

    # THEN the server is in ERROR (no confirm, no auto-confirm, deletes its old disks), its
    # migration in error holding the source's allocation, the fault saying what may be where
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.ERROR, None, DEST)
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR
    assert usage(SOURCE) == OLD_USAGE
    [fault] = faults(resized.instance_uuid)
    assert "removing the new guest and its disks on the destination host" in fault.message
    assert f"may still be on {DEST}, or gone" in fault.details
    assert f"{resized.instance_uuid}_resize on {SOURCE}" in fault.details


def test_a_down_source_host_stops_the_revert_before_the_destination_is_touched(cloud, monkeypatch):
    resized = make_resized()
    event = begin("revert", resized, monkeypatch)
    host_down(SOURCE)

    with pytest.raises(errors.ComputeServiceUnavailable):
        revert_resize.check_resize_to_revert(event)


def test_a_failed_restore_at_the_source_is_error_with_a_fault_saying_what_is_where(cloud, monkeypatch):
    resized = make_resized()
    event = moved_back(reverted_at_dest(checked(begin("revert", resized, monkeypatch))))
    failed = {**event, "error": {"Error": "Ferry.GuestNotFound", "Cause": "no kept disks"}}

    revert_resize.fail_revert(failed)
    revert_resize.fail_revert(failed)

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (states.ERROR, None, SOURCE)
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR
    [fault] = faults(resized.instance_uuid)
    assert "restoring the old guest on the source host" in fault.message
    assert fault.message.endswith(": Ferry.GuestNotFound") and fault.details.endswith("Cause: no kept disks")
    assert f"on {DEST} were removed" in fault.details
    assert f"{resized.instance_uuid}_resize on {SOURCE}" in fault.details
    assert f"points at {SOURCE}" in fault.details and f"on {SOURCE}" in fault.details
    assert events(resized.instance_uuid)[revert_resize.EVENT_FINISH_REVERT] == "Error"


def test_a_failure_moving_resources_back_names_the_allocations_where_they_are(cloud, monkeypatch):
    resized = make_resized()
    event = reverted_at_dest(checked(begin("revert", resized, monkeypatch)))

    revert_resize.fail_revert({**event, "error": {"Error": "OperationalError", "Cause": "database went away"}})

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.host) == (states.ERROR, DEST)
    [fault] = faults(resized.instance_uuid)
    assert "moving allocations, ports and volumes back" in fault.message
    assert f"migration {resized.migration_uuid} DISK_GB 1, MEMORY_MB 512, VCPU 1 on {SOURCE}" in fault.details
    assert f"instance DISK_GB 3, MEMORY_MB 1024, VCPU 2 on {DEST}" in fault.details
    assert events(resized.instance_uuid)[revert_resize.EVENT_REVERT] == "Error"


def test_a_failed_revert_counts_the_server_left_in_error_once(cloud, monkeypatch):
    counted: list[str] = []
    monkeypatch.setattr(metrics, "add_metric", lambda **metric: counted.append(metric["name"]))
    resized = make_resized()
    failed = {**checked(begin("revert", resized, monkeypatch)), "error": {"Error": "States.Timeout", "Cause": ""}}

    revert_resize.fail_revert(failed)
    revert_resize.fail_revert(failed)  # run again: the migration is in error, nothing more happens

    assert instance_row(resized.instance_uuid).vm_state == states.ERROR
    assert counted.count("ServerLeftInError") == 1
