"""The confirm workflow's steps against a real store (SQLite and PostgreSQL).

Each test starts from a server in VERIFY_RESIZE written into the store, accepts the confirm
through the compute API's own code, and drives the steps the way
``statemachine/confirm_resize.asl.json`` does, with what the host agent would answer.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from sqlalchemy import select, update
from verify_resize_helpers import (
    CELL,
    DEST,
    NEW,
    NEW_USAGE,
    OLD,
    OLD_USAGE,
    ROOT,
    SOURCE,
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
    report,
    set_instance,
    snapshot,
    usage,
)

from ferry import errors, notifications, placement, protocol
from ferry.compute import migration_states, states
from ferry.store.api_models import RequestSpec
from ferry.store.cell_models import Migration
from ferry.store.db import api_session
from ferry.workflows import confirm_resize

SCHEMAS = ("confirm_resize", "revert_resize", "volume_attachment", "drain")


@pytest.fixture
def cloud(store, monkeypatch):
    with mocked_aws(monkeypatch) as tap:
        yield tap


def confirmed_at_source(event: dict) -> dict:
    """The state document after ConfirmAtSource, with the host's answer."""
    return {**event, "confirmed_at_source": host_result(event["move"]["source"]["host"], event["instance_uuid"])}


def checked(event: dict) -> dict:
    return {**event, "move": confirm_resize.check_resize_to_confirm(event)}


def test_confirm_leaves_the_new_flavor_on_the_destination_only_and_the_migration_confirmed(cloud, monkeypatch,
                                                                                         tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    event = checked(begin("confirm", resized, monkeypatch))

    move = event["move"]
    assert (move["source"]["host"], move["dest"]["host"], move["same_host"]) == (SOURCE, DEST, False)
    assert move["source"]["queue_url"].endswith(SOURCE)
    jsonschema.validate({"migration_uuid": resized.migration_uuid, "same_host": move["same_host"]},
                        protocol.ARGS_SCHEMAS[protocol.CONFIRM_RESIZE])
    event = confirmed_at_source(event)
    confirm_resize.finish_confirm(event)
    confirm_resize.finish_confirm(event)  # delivered twice: the same end state

    assert usage(SOURCE) == {}
    assert usage(DEST) == NEW_USAGE
    assert placement.get_allocations(resized.migration_uuid) == {}
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.flavor) == (states.ACTIVE, None, DEST, NEW)
    assert (row.old_flavor, row.new_flavor, row.old_vm_state) == (None, None, None)
    assert bindings(resized.instance_uuid) == {DEST: "ACTIVE"}
    assert attachments(resized.instance_uuid) == {DEST: "attached"}
    assert events(resized.instance_uuid) == {confirm_resize.EVENT_CONFIRM: "Success"}
    assert cloud.event_types() == [(notifications.RESIZE_CONFIRM_START, f"compute:{SOURCE}"),
                                   (notifications.RESIZE_CONFIRM_END, f"compute:{SOURCE}")]


@pytest.mark.parametrize("outcome", ["confirmed", "failed at the source"])
def test_a_confirm_records_the_servers_new_flavor_in_its_request_spec(cloud, monkeypatch, outcome):
    # GIVEN a resized server whose request spec holds the flavor it was booted with
    resized = make_resized()
    with api_session() as session:
        row = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == resized.instance_uuid)).one()
        row.spec = {**row.spec, "flavor": OLD}
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))

    # WHEN the confirm ends, or fails at the source leaving the server on its new flavor (delivered twice)
    for _ in range(2):
        if outcome == "confirmed":
            confirm_resize.finish_confirm(event)
        else:
            confirm_resize.fail_confirm({**event, "error": {"Error": "Ferry.HostOperationFailed", "Cause": "busy"}})

    # THEN the spec holds the flavor the server has now (what a server of a cell that does not
    # answer is shown with)
    with api_session() as session:
        spec = session.scalars(select(RequestSpec.spec).where(RequestSpec.instance_uuid == resized.instance_uuid)).one()
    assert spec["flavor"] == NEW == instance_row(resized.instance_uuid).flavor


def test_a_confirm_run_again_after_a_newer_move_leaves_that_moves_flavor_out_of_the_spec(cloud, monkeypatch):
    # GIVEN a confirmed move, and then a newer move of the server waiting in VERIFY_RESIZE
    resized = make_resized()
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))
    confirm_resize.finish_confirm(event)
    bigger = {**NEW, "id": 3, "flavorid": "3", "name": "m1.large", "vcpus": 4}
    set_instance(resized.instance_uuid, vm_state=states.RESIZED, flavor=bigger, old_flavor=NEW, new_flavor=bigger)

    # WHEN the first confirm's last step runs again (Step Functions delivered it late)
    confirm_resize.finish_confirm(event)

    # THEN the spec keeps the confirmed flavor, not the newer move's
    with api_session() as session:
        spec = session.scalars(select(RequestSpec.spec).where(RequestSpec.instance_uuid == resized.instance_uuid)).one()
    assert spec["flavor"] == NEW


def test_a_stopped_server_stays_shutoff_after_confirm(cloud, monkeypatch):
    resized = make_resized(old_vm_state=states.STOPPED)
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))

    confirm_resize.finish_confirm(event)

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.power_state, states.api_status(row.vm_state, row.task_state)) == (
        states.STOPPED, states.SHUTDOWN, "SHUTOFF")


def test_a_same_host_confirm_keeps_the_one_binding_and_drops_only_the_old_flavor(cloud, monkeypatch):
    resized = make_resized(source=SOURCE, dest=SOURCE)
    assert usage(SOURCE) == {rc: OLD_USAGE[rc] + NEW_USAGE[rc] for rc in NEW_USAGE}
    event = checked(begin("confirm", resized, monkeypatch))
    assert event["move"]["same_host"] is True

    confirm_resize.finish_confirm(confirmed_at_source(event))

    assert usage(SOURCE) == NEW_USAGE
    assert bindings(resized.instance_uuid) == {SOURCE: "ACTIVE"}


def test_input_that_does_not_match_the_schema_is_refused_and_changes_nothing(cloud, monkeypatch):
    resized = make_resized()
    event = begin("confirm", resized, monkeypatch)
    before = snapshot(resized)

    for bad in ({k: v for k, v in event.items() if k != "migration_uuid"}, {**event, "flavor": "big"},
                {**event, "instance_uuid": "not-a-uuid"}):
        with pytest.raises(errors.InvalidWorkflowInput):
            confirm_resize.check_resize_to_confirm(bad)

    assert snapshot(resized) == before


def test_a_migration_nobody_is_confirming_is_refused(cloud, monkeypatch):
    resized = make_resized()
    before = snapshot(resized)
    event = {"instance_uuid": resized.instance_uuid, "migration_uuid": resized.migration_uuid, "cell": CELL,
             "request_id": "req-by-hand"}

    with pytest.raises(errors.UnexpectedMigrationState):
        confirm_resize.check_resize_to_confirm(event)
    other = make_resized()
    with pytest.raises(errors.MigrationNotFound):
        confirm_resize.check_resize_to_confirm({**event, "migration_uuid": other.migration_uuid})

    assert snapshot(resized) == before
    assert events(resized.instance_uuid) == {}


def test_a_down_source_host_is_not_a_refusal_and_the_rollback_restores_verify_resize(cloud, monkeypatch):
    resized = make_resized()
    event = begin("confirm", resized, monkeypatch)
    host_down(SOURCE)  # after the API accepted the confirm

    with pytest.raises(errors.ComputeServiceUnavailable) as raised:
        confirm_resize.check_resize_to_confirm(event)
    error = {"Error": raised.value.name, "Cause": raised.value.message}
    confirm_resize.restore_verify_resize({**event, "error": error})

    assert migration_row(resized.migration_uuid).status == migration_states.FINISHED
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.RESIZED, None)
    assert placement.get_allocations(resized.migration_uuid) != {}
    assert events(resized.instance_uuid) == {confirm_resize.EVENT_CONFIRM: "Error"}
    report(SOURCE)  # the host is back
    begin("confirm", resized, monkeypatch)  # the owner can confirm again
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMING


def test_a_restore_leaves_a_migration_a_delete_confirmed_after_it_was_read(cloud, monkeypatch):
    # GIVEN a confirm whose first step failed on a down source host, and a delete that confirms
    # the migration just after the restore read it (as READ COMMITTED lets a concurrent commit show)
    resized = make_resized()
    event = begin("confirm", resized, monkeypatch)
    read = confirm_resize.migration_of

    def read_then_confirmed_elsewhere(session, uuid, migration_uuid):
        migration = read(session, uuid, migration_uuid)
        session.execute(update(Migration).where(Migration.uuid == migration_uuid)
                        .values(status=migration_states.CONFIRMED).execution_options(synchronize_session=False))
        return migration

    monkeypatch.setattr(confirm_resize, "migration_of", read_then_confirmed_elsewhere)

    # WHEN the restore runs
    confirm_resize.restore_verify_resize({**event, "error": {"Error": "Ferry.ComputeServiceUnavailable",
                                                             "Cause": "source host down"}})

    # THEN the delete's confirmed stands
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED


def test_a_failure_at_the_source_leaves_the_server_usable_and_says_what_is_left(cloud, monkeypatch, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    event = checked(begin("confirm", resized, monkeypatch))
    failed = {**event, "error": {"Error": "Ferry.HostOperationFailed", "Cause": "disk busy"}}

    confirm_resize.fail_confirm(failed)
    confirm_resize.fail_confirm(failed)  # delivered twice: one fault

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.flavor, row.old_flavor) == (
        states.ACTIVE, None, DEST, NEW, None)
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR
    assert usage(SOURCE) == OLD_USAGE, "the migration keeps its allocation while the old disks may be there"
    [fault] = faults(resized.instance_uuid)
    assert fault.message == "Confirming the resize failed on the source host: Ferry.HostOperationFailed"
    assert fault.details.endswith("Cause: disk busy")  # the host's words are the admin's
    assert SOURCE not in fault.message and SOURCE in fault.details  # the owner reads the message
    assert f"{resized.instance_uuid}_resize" in fault.details and resized.migration_uuid in fault.details
    assert events(resized.instance_uuid) == {confirm_resize.EVENT_CONFIRM: "Error"}


def test_an_operator_confirm_of_the_failed_migration_cleans_up_without_touching_the_server(cloud, monkeypatch):
    resized = make_resized()
    event = checked(begin("confirm", resized, monkeypatch))
    confirm_resize.fail_confirm({**event, "error": {"Error": "States.Timeout", "Cause": ""}})
    retry = {k: event[k] for k in ("instance_uuid", "migration_uuid", "cell")} | {"request_id": "req-cleanup"}

    retry = checked(retry)
    confirm_resize.finish_confirm(confirmed_at_source(retry))

    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    assert usage(SOURCE) == {} and usage(DEST) == NEW_USAGE
    assert bindings(resized.instance_uuid) == {DEST: "ACTIVE"}
    assert instance_row(resized.instance_uuid).vm_state == states.ACTIVE


@pytest.mark.parametrize("reset_to", [states.ACTIVE, states.ERROR])
def test_a_confirm_whose_server_an_admin_reset_meanwhile_still_cleans_up_the_source(cloud, monkeypatch, reset_to):
    # GIVEN a confirm accepted, and the server reset (to active, or to error) before the workflow's first step
    resized = make_resized()
    event = begin("confirm", resized, monkeypatch)
    set_instance(resized.instance_uuid, vm_state=reset_to, task_state=None)

    # WHEN the confirm's steps run
    event = confirmed_at_source(checked(event))
    confirm_resize.finish_confirm(event)

    # THEN the source holds nothing, and the migration is confirmed rather than left confirming
    assert usage(SOURCE) == {} and placement.get_allocations(resized.migration_uuid) == {}
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host) == (reset_to, None, DEST)


def test_a_failed_migration_whose_server_went_elsewhere_is_not_taken_for_a_cleanup(cloud, monkeypatch):
    resized = make_resized()
    event = checked(begin("confirm", resized, monkeypatch))
    confirm_resize.fail_confirm({**event, "error": {"Error": "States.Timeout", "Cause": ""}})
    set_instance(resized.instance_uuid, host=SOURCE)

    with pytest.raises(errors.UnexpectedMigrationState):
        confirm_resize.check_resize_to_confirm({k: event[k] for k in ("instance_uuid", "migration_uuid", "cell",
                                                                      "request_id")})


def test_a_failure_after_the_source_was_cleaned_says_so(cloud, monkeypatch):
    resized = make_resized()
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))

    confirm_resize.fail_confirm({**event, "error": {"Error": "OperationalError", "Cause": "database went away"}})

    [fault] = faults(resized.instance_uuid)
    assert "removed the old guest and disks" in fault.message
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR


def test_a_failure_after_the_source_was_cleaned_releases_what_the_migration_held_there(cloud, monkeypatch,
                                                                                        tmp_path):
    # GIVEN a confirm whose source host removed the old guest and disks, and whose FinishConfirm failed
    resized = make_resized(volume=True, state_dir=tmp_path)
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))
    assert usage(SOURCE) == OLD_USAGE and SOURCE in bindings(resized.instance_uuid)

    # WHEN FailConfirm runs
    confirm_resize.fail_confirm({**event, "error": {"Error": "OperationalError", "Cause": "database went away"}})

    # THEN the migration's allocation and the source's bindings and attachments are gone, as a
    # confirm leaves them; the server keeps what it has on the destination
    assert usage(SOURCE) == {} and placement.get_allocations(resized.migration_uuid) == {}
    assert usage(DEST) == NEW_USAGE
    assert bindings(resized.instance_uuid) == {DEST: "ACTIVE"}
    assert attachments(resized.instance_uuid) == {DEST: "attached"}
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR
    [fault] = faults(resized.instance_uuid)
    assert "was released" in fault.details and "its allocation: none" in fault.details


def test_a_failure_after_the_source_was_cleaned_keeps_the_allocation_when_it_cannot_be_released(cloud, monkeypatch):
    # GIVEN a confirm failed after the source was cleaned, whose release fails again in FailConfirm
    resized = make_resized()
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))

    def refused(*_args, **_kwargs):
        raise RuntimeError("placement went away")

    with monkeypatch.context() as patched:
        patched.setattr(confirm_resize, "release_source", refused)
        confirm_resize.fail_confirm({**event, "error": {"Error": "OperationalError", "Cause": "went away"}})

    # THEN the failure is recorded all the same, the migration holding its allocation, and a
    # FailConfirm run again (its commit's answer lost) does not release what a newer move may hold
    assert migration_row(resized.migration_uuid).status == migration_states.ERROR
    assert usage(SOURCE) == OLD_USAGE
    [fault] = faults(resized.instance_uuid)
    assert "was released" not in fault.details and "VCPU" in fault.details
    confirm_resize.fail_confirm({**event, "error": {"Error": "OperationalError", "Cause": "went away"}})
    assert usage(SOURCE) == OLD_USAGE and SOURCE in bindings(resized.instance_uuid)


def test_a_server_deleted_during_the_confirm_is_left_to_its_delete(cloud, monkeypatch):
    resized = make_resized()
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))
    set_instance(resized.instance_uuid, task_state=states.DELETING)

    confirm_resize.finish_confirm(event)

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.RESIZED, states.DELETING)
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    assert usage(SOURCE) == {}


def test_a_confirm_whose_migration_a_delete_confirmed_meanwhile_still_ends_its_action(cloud, monkeypatch):
    # GIVEN a confirm under way, and a delete that came meanwhile confirmed the migration itself
    # (ConfirmBeforeDelete) before FinishConfirm ran
    resized = make_resized()
    event = confirmed_at_source(checked(begin("confirm", resized, monkeypatch)))
    set_instance(resized.instance_uuid, task_state=states.DELETING)
    confirm_resize.finish_confirm({**event, "request_id": "req-the-delete"})  # what the delete's step leaves
    assert migration_row(resized.migration_uuid).status == migration_states.CONFIRMED
    cloud.event_types()  # what the delete announced, read and set aside

    # WHEN the confirm's FinishConfirm runs (twice)
    confirm_resize.finish_confirm(event)
    confirm_resize.finish_confirm(event)

    # THEN its action ends (its event finished), and its end is announced once
    assert events(resized.instance_uuid) == {confirm_resize.EVENT_CONFIRM: "Success"}
    assert cloud.event_types() == [(notifications.RESIZE_CONFIRM_END, f"compute:{SOURCE}")]


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_input_schema_beside_the_state_machine_is_the_one_the_step_uses(name):
    beside = json.loads((ROOT / "statemachine" / f"{name}.input.schema.json").read_text())
    used = json.loads((ROOT / "layers/core/python/ferry/workflows" / f"{name}.input.schema.json").read_text())

    assert beside == used
    jsonschema.Draft202012Validator.check_schema(beside)


def test_a_confirm_whose_steps_run_twice_announces_each_event_under_one_message_id(cloud, monkeypatch):
    # GIVEN a confirm whose first and last steps each ran twice
    resized = make_resized()
    event = begin("confirm", resized, monkeypatch)
    confirm_resize.check_resize_to_confirm(event)
    event = confirmed_at_source(checked(event))
    confirm_resize.finish_confirm(event)
    confirm_resize.finish_confirm(event)

    # THEN each event's copies share one message id, and the start's differs from the end's
    published = cloud.drain()
    ids = {n["event_type"]: set() for n in published}
    for n in published:
        ids[n["event_type"]].add(n["message_id"])
    assert sorted(ids) == ["instance.resize_confirm.end", "instance.resize_confirm.start"]
    assert all(len(copies) == 1 for copies in ids.values())
    assert ids["instance.resize_confirm.start"] != ids["instance.resize_confirm.end"]
    assert [n["event_type"] for n in published].count("instance.resize_confirm.start") == 2
