"""Attaching and detaching volumes: acceptance and the workflow's steps (SQLite and PostgreSQL),
above all while a server is in VERIFY_RESIZE, where a revert must bring the volume along."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from verify_resize_helpers import (
    CELL,
    DEST,
    PROJECT,
    SOURCE,
    USER,
    Resized,
    attachments,
    begin,
    events,
    faults,
    host_result,
    instance_row,
    make_resized,
    make_volume,
    migration_row,
    mocked_aws,
    set_instance,
    volume_status,
)

from ferry import audit, errors, placement, protocol, workflows
from ferry.auth import RequestContext
from ferry.compute import api as compute_api
from ferry.compute import states
from ferry.store.api_models import VolumeAttachment
from ferry.store.cell_models import BlockDeviceMapping
from ferry.store.db import api_session, cell_session
from ferry.workflows import confirm_resize, revert_resize
from ferry.workflows import volume_attachment as va
from hostagent.driver import VOLUME, DiskSpec, LibvirtDriver, write_test_node_xml


class Started:
    def __init__(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.fail = False
        self.began = False  # with fail: the workflow began, its first step ran, yet the start answered an error

    def __call__(self, arn: str, name: str, payload: dict[str, Any]) -> str:
        self.payloads.append({**payload, "execution_name": name})
        if self.fail:
            if self.began:
                va.check_volume_operation(payload)
            raise RuntimeError("Step Functions is unreachable")
        return f"{arn}:{name}"


@pytest.fixture
def started(store, monkeypatch):
    with mocked_aws(monkeypatch):
        recorder = Started()
        monkeypatch.setattr(workflows, "start_execution", recorder)
        yield recorder


def owner() -> RequestContext:
    return RequestContext(user_id=USER, project_id=PROJECT, roles=("member",))


def location(resized: Resized) -> compute_api.Location:
    return compute_api.locate(owner(), resized.instance_uuid)


def bdms(instance_uuid: str) -> list[tuple[str | None, bool]]:
    with cell_session(CELL) as session:
        return [(b.volume_id, b.deleted) for b in session.scalars(
            select(BlockDeviceMapping).where(BlockDeviceMapping.instance_uuid == instance_uuid))]


def done_at_host(payload: dict[str, Any]) -> dict[str, Any]:
    """CheckVolumeOperation → AttachAtHost or DetachAtHost (answered): FinishVolumeOperation's input."""
    event = {**payload, "volume_op": va.check_volume_operation(payload)}
    args = event["volume_op"]["args"]
    jsonschema.validate(args, protocol.ARGS_SCHEMAS[protocol.ATTACH_VOLUME if payload["operation"] == va.ATTACH
                                                    else protocol.DETACH_VOLUME])
    event["attached" if payload["operation"] == va.ATTACH else "detached"] = host_result(
        event["volume_op"]["host"], payload["instance_uuid"], states.RUNNING)
    return event


def run_attach(payload: dict[str, Any]) -> dict[str, Any]:
    """CheckVolumeOperation → AttachAtHost (answered) → FinishVolumeOperation."""
    event = done_at_host(payload)
    va.finish_volume_operation(event)
    va.finish_volume_operation(event)  # delivered twice
    return event


def finish_with_the_cell_unreachable(event: dict[str, Any], monkeypatch) -> dict[str, Any]:
    """FinishVolumeOperation and its three retries, each reading the request in the cell, committing
    the API database's part and then failing on the cell's; returns FailVolumeOperation's input
    (after UndoAttach, and for an attach DetachAfterFailedAttach answered)."""
    reachable = va.cell_session
    calls: list[int] = []

    def lost_after_first_read(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) % 2:
            return reachable(*args, **kwargs)
        raise OperationalError("SELECT 1", {}, ConnectionRefusedError("cell database unreachable"))

    with monkeypatch.context() as patched:
        patched.setattr(va, "cell_session", lost_after_first_read)
        for _ in range(4):
            with pytest.raises(OperationalError):
                va.finish_volume_operation(event)
    return {**event, "error": {"Error": "OperationalError", "Cause": "cell database unreachable"}}


def ask(operation: str, resized: Resized, tmp_path) -> str:
    """Ask for an attach of a new volume to ``resized`` or a detach of its volume; the volume's id."""
    if operation == va.ATTACH:
        volume_id = make_volume(tmp_path)
        va.begin_attach(owner(), location(resized), volume_id)
    else:
        volume_id = str(resized.volume_id)
        va.begin_detach(owner(), location(resized), volume_id)
    return volume_id


def hold(volume_id: str, instance_uuid: str, host: str = DEST) -> None:
    """An attachment of another server holds the volume (a boot's reservation, or records left over)."""
    with api_session() as session:
        session.add(VolumeAttachment(volume_id=volume_id, instance_uuid=instance_uuid, host=host, device="vde",
                                     status="attached"))


def test_a_volume_attached_while_resized_is_restored_by_the_revert(started, monkeypatch, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)

    attachment = va.begin_attach(owner(), location(resized), volume_id)
    assert (attachment.device_path, attachment.volume_id) == ("/dev/vdd", volume_id)
    assert attachments(resized.instance_uuid) == {DEST: "reserved", SOURCE: "reserved"}
    assert instance_row(resized.instance_uuid).task_state == va.ATTACHING_VOLUME
    [payload] = started.payloads
    jsonschema.validate(payload, va.INPUT_SCHEMA)
    event = run_attach(payload)
    assert event["volume_op"]["host"] == DEST
    assert event["volume_op"]["args"]["volume"]["device"] == "vdd"
    assert attachments(resized.instance_uuid) == {DEST: "attached", SOURCE: "reserved"}
    assert (volume_status(volume_id), instance_row(resized.instance_uuid).task_state) == ("in-use", None)
    assert events(resized.instance_uuid) == {va.EVENT_ATTACH: "Success"}

    revert = begin("revert", resized, monkeypatch)
    revert = {**revert, "move": revert_resize.check_resize_to_revert(revert)}
    revert["reverted_at_dest"] = host_result(DEST, resized.instance_uuid)
    args = revert_resize.revert_resources_to_source(revert)["finish_args"]

    assert [(v["volume_id"], v["device"], v["path"]) for v in args["volumes"]] == [
        (volume_id, "vdd", str(tmp_path / "volumes" / volume_id))]
    assert attachments(resized.instance_uuid) == {SOURCE: "attached"}


def test_a_volume_detached_while_resized_is_gone_from_both_hosts_and_from_the_revert(started, monkeypatch,
                                                                                     tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    assert resized.volume_id is not None
    assert attachments(resized.instance_uuid) == {DEST: "attached", SOURCE: "attached"}

    va.begin_detach(owner(), location(resized), resized.volume_id)
    assert volume_status(resized.volume_id) == va.DETACHING
    event = run_attach(started.payloads[0])
    assert event["volume_op"]["args"] == {"volume_id": resized.volume_id}

    assert attachments(resized.instance_uuid) == {}
    assert volume_status(resized.volume_id) == "available"
    assert bdms(resized.instance_uuid) == [(resized.volume_id, True)]
    revert = begin("revert", resized, monkeypatch)
    revert = {**revert, "move": revert_resize.check_resize_to_revert(revert)}
    assert revert_resize.revert_resources_to_source(revert)["finish_args"]["volumes"] == []


def test_a_confirm_drops_the_reserved_source_attachment(started, monkeypatch, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    run_attach(started.payloads[0])

    confirm = begin("confirm", resized, monkeypatch)
    confirm = {**confirm, "move": confirm_resize.check_resize_to_confirm(confirm)}
    confirm_resize.finish_confirm(confirm)

    assert attachments(resized.instance_uuid) == {DEST: "attached"}


def test_a_busy_server_or_a_used_volume_is_refused_and_nothing_is_written(started, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    set_instance(resized.instance_uuid, task_state=states.RESIZE_REVERTING)

    with pytest.raises(errors.InstanceInvalidState):
        va.begin_attach(owner(), location(resized), volume_id)
    assert volume_status(volume_id) == "available"
    set_instance(resized.instance_uuid, task_state=None)
    va.begin_attach(owner(), location(resized), volume_id)
    with pytest.raises(errors.InstanceInvalidState):
        va.begin_attach(owner(), location(resized), make_volume(tmp_path))  # attach under way
    other = make_resized(state_dir=tmp_path)
    with pytest.raises(errors.VolumeInUse):
        va.begin_attach(owner(), location(other), volume_id)

    assert len(started.payloads) == 1
    assert attachments(other.instance_uuid) == {}
    assert instance_row(other.instance_uuid).task_state is None


def test_a_confirm_or_revert_waits_for_an_attach_under_way(started, monkeypatch, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    va.begin_attach(owner(), location(resized), make_volume(tmp_path))

    with pytest.raises(errors.InstanceInvalidState):
        begin("revert", resized, monkeypatch)
    with pytest.raises(errors.InstanceInvalidState):
        begin("confirm", resized, monkeypatch)


def test_another_projects_volume_is_not_found(started, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    theirs = make_volume(tmp_path, project="someone-else")

    with pytest.raises(errors.VolumeNotFound):
        va.begin_attach(owner(), location(resized), theirs)


def test_an_execution_that_cannot_start_leaves_nothing_behind(started, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    started.fail = True

    with pytest.raises(RuntimeError):
        va.begin_attach(owner(), location(resized), volume_id)

    assert volume_status(volume_id) == "available"
    assert attachments(resized.instance_uuid) == {}
    assert bdms(resized.instance_uuid) == []
    row = instance_row(resized.instance_uuid)
    assert row.task_state is None and events(resized.instance_uuid) == {}


def test_an_attach_that_failed_to_take_the_server_leaves_the_task_of_the_attach_that_took_it(
        started, monkeypatch, tmp_path):
    # GIVEN two attaches to one server that both checked it: the winner takes the server and starts
    # its workflow, then the loser's own take fails on the database
    resized = make_resized(state_dir=tmp_path)
    set_instance(resized.instance_uuid, vm_state=states.ACTIVE)
    winners, losers = make_volume(tmp_path), make_volume(tmp_path)
    take = va._take_server

    def taken_meanwhile_then_lost(*args: Any) -> None:
        monkeypatch.setattr(va, "_take_server", take)
        va.begin_attach(owner(), location(resized), winners)
        raise OperationalError("UPDATE instances", {}, ConnectionResetError("cell database connection lost"))

    monkeypatch.setattr(va, "_take_server", taken_meanwhile_then_lost)

    # WHEN the loser's attach is undone
    with pytest.raises(OperationalError):
        va.begin_attach(owner(), location(resized), losers)

    # THEN the loser leaves nothing behind and the winner keeps the server's task, and finishes
    assert volume_status(losers) == va.AVAILABLE
    assert instance_row(resized.instance_uuid).task_state == va.ATTACHING_VOLUME
    assert bdms(resized.instance_uuid) == [(winners, False)]
    [payload] = started.payloads
    run_attach(payload)
    assert volume_status(winners) == va.IN_USE
    assert attachments(resized.instance_uuid) == {DEST: "attached"}
    assert instance_row(resized.instance_uuid).task_state is None
    assert events(resized.instance_uuid) == {va.EVENT_ATTACH: "Success"}


@pytest.mark.parametrize("operation", [va.ATTACH, va.DETACH])
def test_a_request_whose_workflow_began_though_its_start_answered_an_error_stands(started, tmp_path, operation):
    # GIVEN starting the workflow answers an error, though it began: its first step took the request
    resized = make_resized(volume=operation == va.DETACH, state_dir=tmp_path)
    started.fail = started.began = True

    # WHEN the attach or detach is asked for
    volume_id = ask(operation, resized, tmp_path)

    # THEN it stands as accepted, for its workflow to finish
    assert instance_row(resized.instance_uuid).task_state == va._TASK_STATE[operation]
    assert volume_status(volume_id) == (va.ATTACHING if operation == va.ATTACH else va.DETACHING)
    assert events(resized.instance_uuid) == {va._EVENT[operation]: None}
    va.finish_volume_operation(done_at_host(started.payloads[0]))
    assert volume_status(volume_id) == (va.IN_USE if operation == va.ATTACH else va.AVAILABLE)


@pytest.mark.parametrize("operation", [va.ATTACH, va.DETACH])
def test_the_first_step_of_a_request_the_api_undid_changes_nothing(started, tmp_path, operation):
    # GIVEN the API undid an attach or detach whose start answered an error
    resized = make_resized(volume=operation == va.DETACH, state_dir=tmp_path)
    started.fail = True
    volume_id = make_volume(tmp_path) if operation == va.ATTACH else str(resized.volume_id)
    with pytest.raises(RuntimeError):
        (va.begin_attach if operation == va.ATTACH else va.begin_detach)(owner(), location(resized), volume_id)
    [payload] = started.payloads

    # WHEN its workflow's first step runs after all, THEN it refuses, and nothing is recorded
    with pytest.raises((errors.UnexpectedTaskState, errors.VolumeNotAttached)):
        va.check_volume_operation({k: v for k, v in payload.items() if k != "execution_name"})
    assert instance_row(resized.instance_uuid).task_state is None
    assert events(resized.instance_uuid) == {}
    assert volume_status(volume_id) == (va.AVAILABLE if operation == va.ATTACH else va.IN_USE)


@pytest.mark.parametrize("operation", [va.ATTACH, va.DETACH])
def test_an_undo_stopped_after_the_servers_part_is_finished_by_the_audit(started, monkeypatch, tmp_path, operation):
    # GIVEN an attach or detach whose start answered an error, and whose undo then failed after the
    # server's part (task cleared), before the volume's status was put back
    resized = make_resized(volume=operation == va.DETACH, state_dir=tmp_path)
    started.fail = True
    swap = va._swap_volume_status

    def database_lost(volume_id: str, expected: str, new: str, *conditions: Any) -> bool:
        if (expected, new) in ((va.ATTACHING, va.AVAILABLE), (va.DETACHING, va.IN_USE)):
            raise OperationalError("UPDATE volumes", {}, ConnectionRefusedError("API database unreachable"))
        return swap(volume_id, expected, new, *conditions)

    monkeypatch.setattr(va, "_swap_volume_status", database_lost)
    with pytest.raises(OperationalError):
        ask(operation, resized, tmp_path)
    monkeypatch.setattr(va, "_swap_volume_status", swap)
    volume_id = started.payloads[0]["volume_id"]
    assert instance_row(resized.instance_uuid).task_state is None
    assert volume_status(volume_id) == (va.ATTACHING if operation == va.ATTACH else va.DETACHING)

    # WHEN the audit runs with --fix, THEN it puts the volume back as the server's records say
    report = audit.run_audit(fix=True, grace_seconds=0, clock_skew_seconds=0, running_executions=set(),
                             check_storage=False)
    assert [r.error for r in report.repairs if r.problem.kind == audit.VOLUME_OPERATION_LEFT] == [None]
    assert volume_status(volume_id) == (va.AVAILABLE if operation == va.ATTACH else va.IN_USE)
    assert not report.of_kind(audit.VOLUME_OPERATION_LEFT)
    # and the volume may be attached or detached again
    started.fail = False
    if operation == va.ATTACH:
        va.begin_attach(owner(), location(resized), volume_id)
    else:
        va.begin_detach(owner(), location(resized), volume_id)
    va.finish_volume_operation(done_at_host(started.payloads[-1]))
    assert volume_status(volume_id) == (va.IN_USE if operation == va.ATTACH else va.AVAILABLE)


def test_a_failed_attach_is_rolled_back_completely(started, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    payload = started.payloads[0]
    event = {**payload, "volume_op": va.check_volume_operation(payload),
             "error": {"Error": "Ferry.HypervisorError", "Cause": "device vdd is taken"}}

    va.fail_volume_operation(event)
    va.fail_volume_operation(event)

    assert volume_status(volume_id) == "available"
    assert attachments(resized.instance_uuid) == {}
    assert bdms(resized.instance_uuid) == []
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.RESIZED, None)
    [fault] = faults(resized.instance_uuid)
    assert fault.message == f"Volume attach of {volume_id} failed: Ferry.HypervisorError"
    assert fault.details == "Cause: device vdd is taken"  # the host's words are the admin's
    assert events(resized.instance_uuid) == {va.EVENT_ATTACH: "Error"}


def test_a_failed_attach_the_host_could_not_detach_again_stays_attached_for_a_detach_to_free(started, tmp_path):
    # GIVEN an attach that failed at the host, whose DetachAfterFailedAttach failed too: the guest
    # may still see the volume
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    payload = started.payloads[0]
    event = {**payload, "volume_op": va.check_volume_operation(payload),
             "error": {"Error": "States.Timeout", "Cause": ""},
             "cleanup_error": {"Error": "States.Timeout", "Cause": ""}}

    # WHEN FailVolumeOperation runs (twice)
    va.fail_volume_operation(event)
    va.fail_volume_operation(event)

    # THEN the volume is not freed for another server: it stays attached to this one, in-use with its
    # mapping, the fault saying so; and a detach frees it
    assert volume_status(volume_id) == "in-use"
    assert attachments(resized.instance_uuid)[DEST] == "attached"
    assert (volume_id, False) in bdms(resized.instance_uuid)
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state) == (states.RESIZED, None)
    [fault] = faults(resized.instance_uuid)
    assert "stays attached" in fault.details
    va.begin_detach(owner(), location(resized), volume_id)
    va.finish_volume_operation(done_at_host(started.payloads[-1]))
    assert volume_status(volume_id) == "available"


def test_a_failed_detach_leaves_the_volume_attached(started, tmp_path):
    # GIVEN a detach the host failed: the guest may still see the volume
    resized = make_resized(volume=True, state_dir=tmp_path)
    assert resized.volume_id is not None
    va.begin_detach(owner(), location(resized), resized.volume_id)
    payload = started.payloads[0]
    event = {**payload, "volume_op": va.check_volume_operation(payload),
             "error": {"Error": "Ferry.HypervisorError", "Cause": "the guest still has the device"}}

    # WHEN FailVolumeOperation runs
    va.fail_volume_operation(event)

    # THEN the volume stays attached, with its mapping, and the task is cleared
    assert volume_status(resized.volume_id) == "in-use"
    assert attachments(resized.instance_uuid) == {DEST: "attached", SOURCE: "attached"}
    assert (resized.volume_id, False) in bdms(resized.instance_uuid)
    assert instance_row(resized.instance_uuid).task_state is None


def assert_attach_left_nothing(instance_uuid: str, volume_id: str, tmp_path) -> None:
    """A failed attach rolled back: the volume is free (another server attaches it), with neither
    attachment nor mapping left, the server's task cleared and its attach event an Error."""
    assert volume_status(volume_id) == va.AVAILABLE
    assert attachments(instance_uuid) == {}
    assert bdms(instance_uuid) == []
    assert instance_row(instance_uuid).task_state is None
    assert events(instance_uuid) == {va.EVENT_ATTACH: "Error"}
    other = make_resized(state_dir=tmp_path)
    va.begin_attach(owner(), location(other), volume_id)
    assert volume_status(volume_id) == va.ATTACHING


def host_without_guests(tmp_path) -> LibvirtDriver:
    """The driver of a host that has no guest at all (reinstalled, or the server's build never made one)."""
    return LibvirtDriver(write_test_node_xml(tmp_path / "node.xml", vcpus=4, memory_mb=4096),
                         disk_path=tmp_path / "instances")


def at_host(event: dict[str, Any], key: str, call: Callable[[], None]) -> dict[str, Any]:
    """A host agent's Task: ``call`` answered, or its error under ``key`` as Step Functions catches it."""
    try:
        call()
    except errors.HostOperationFailed as exc:
        return {**event, key: {"Error": exc.name, "Cause": str(exc)}}
    return event


def test_an_attach_to_a_server_whose_host_has_no_guest_for_it_leaves_the_volume_free(started, tmp_path):
    # GIVEN an ACTIVE server on a host that has no guest for it (an admin reset its failed build)
    resized = make_resized(state_dir=tmp_path)
    set_instance(resized.instance_uuid, vm_state=states.ACTIVE)
    volume_id = make_volume(tmp_path)
    driver = host_without_guests(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    payload = started.payloads[0]
    event = {**payload, "volume_op": va.check_volume_operation(payload)}
    volume = event["volume_op"]["args"]["volume"]
    disk = DiskSpec(kind=VOLUME, path=volume["path"], device=volume["device"], volume_id=volume_id)

    # WHEN the host fails the attach (AttachAtHost), then detaches the volume again
    # (DetachAfterFailedAttach), and FailVolumeOperation runs
    try:
        event = at_host(event, "error", lambda: driver.attach_volume(resized.instance_uuid, disk))
        assert event["error"]["Error"] == "Ferry.GuestNotFound"
        event = at_host(event, "cleanup_error", lambda: driver.detach_volume(resized.instance_uuid, volume_id))
    finally:
        driver.close()
    va.fail_volume_operation(event)

    # THEN no guest ever had the volume: it is free, with neither attachment nor mapping left
    assert "cleanup_error" not in event
    assert_attach_left_nothing(resized.instance_uuid, volume_id, tmp_path)


def test_a_volume_of_a_server_whose_host_has_no_guest_for_it_can_be_detached(started, tmp_path):
    # GIVEN an ACTIVE server holding a volume, on a host that has no guest for it
    resized = make_resized(volume=True, state_dir=tmp_path)
    set_instance(resized.instance_uuid, vm_state=states.ACTIVE)
    volume_id = str(resized.volume_id)
    driver = host_without_guests(tmp_path)
    va.begin_detach(owner(), location(resized), volume_id)
    event = {**started.payloads[0], "volume_op": va.check_volume_operation(started.payloads[0])}

    # WHEN the host detaches it (DetachAtHost)
    try:
        driver.detach_volume(resized.instance_uuid, volume_id)
    finally:
        driver.close()
    event["detached"] = host_result(DEST, resized.instance_uuid)
    va.finish_volume_operation(event)

    # THEN the volume is freed
    assert volume_status(volume_id) == va.AVAILABLE
    assert attachments(resized.instance_uuid) == {}
    assert bdms(resized.instance_uuid) == [(volume_id, True)]
    assert instance_row(resized.instance_uuid).task_state is None


def test_input_and_records_not_those_of_an_operation_under_way_are_refused(started, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    payload = {"instance_uuid": resized.instance_uuid, "cell": CELL, "request_id": "req-by-hand",
               "operation": va.ATTACH, "volume_id": volume_id}

    with pytest.raises(errors.UnexpectedTaskState):
        va.check_volume_operation(payload)
    with pytest.raises(errors.InvalidWorkflowInput):
        va.check_volume_operation({**payload, "operation": "swap"})
    assert volume_status(volume_id) == "available" and events(resized.instance_uuid) == {}


def test_the_root_volume_cannot_be_detached(started, tmp_path):
    resized = make_resized(volume=True, state_dir=tmp_path)
    with cell_session(CELL) as session:
        bdm = session.scalars(select(BlockDeviceMapping).where(
            BlockDeviceMapping.instance_uuid == resized.instance_uuid)).one()
        bdm.boot_index = 0
    assert resized.volume_id is not None

    with pytest.raises(errors.BadRequest):
        va.begin_detach(owner(), location(resized), resized.volume_id)
    assert volume_status(resized.volume_id) == "in-use"
    assert instance_row(resized.instance_uuid).task_state is None


def test_no_attach_while_a_confirm_is_under_way(started, monkeypatch, tmp_path):
    resized = make_resized(state_dir=tmp_path)
    begin("confirm", resized, monkeypatch)

    with pytest.raises(errors.InstanceInvalidState):
        va.begin_attach(owner(), location(resized), make_volume(tmp_path))


def test_a_confirm_that_raced_an_attach_settles_the_server_and_leaves_the_attach_its_task(started, monkeypatch,
                                                                                          tmp_path):
    resized = make_resized(state_dir=tmp_path)
    confirm = begin("confirm", resized, monkeypatch)
    confirm = {**confirm, "move": confirm_resize.check_resize_to_confirm(confirm)}
    set_instance(resized.instance_uuid, task_state=va.ATTACHING_VOLUME)

    confirm_resize.finish_confirm(confirm)

    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.old_flavor) == (states.ACTIVE, va.ATTACHING_VOLUME, None)


def accepted_between_check_and_take(kind: str, resized: Resized, monkeypatch) -> list[dict[str, Any]]:
    """Make the next attach's acceptance race a confirm or revert: the compute API accepts ``kind``
    after the attach checked the server and before it takes the server's task. The execution
    input of the accepted confirm or revert is appended to the returned list."""
    accepted: list[dict[str, Any]] = []
    swap = va._swap_volume_status

    def swap_after_accepting(volume_id: str, expected: str, status: str, *holders: Any) -> bool:
        if not accepted:
            accepted.append(begin(kind, resized, monkeypatch))
        return swap(volume_id, expected, status, *holders)

    monkeypatch.setattr(va, "_swap_volume_status", swap_after_accepting)
    return accepted


def test_a_confirm_accepted_while_an_attach_takes_the_server_is_confirmed_and_the_attach_completes(
        started, monkeypatch, tmp_path):
    # GIVEN an attach that checked the server while its migration was finished, and a confirm
    # accepted right after (the migration confirming, no task set), before the attach took the task
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    accepted = accepted_between_check_and_take("confirm", resized, monkeypatch)
    va.begin_attach(owner(), location(resized), volume_id)
    [confirm] = accepted
    assert instance_row(resized.instance_uuid).task_state == va.ATTACHING_VOLUME
    assert migration_row(resized.migration_uuid).status == "confirming"

    # WHEN the confirm workflow and the attach workflow both run
    confirm = {**confirm, "move": confirm_resize.check_resize_to_confirm(confirm)}
    confirm["confirmed_at_source"] = host_result(SOURCE, resized.instance_uuid)
    confirm_resize.finish_confirm(confirm)
    run_attach(started.payloads[0])

    # THEN the move is confirmed (nothing is left confirming) and the volume is attached
    row = instance_row(resized.instance_uuid)
    assert (row.vm_state, row.task_state, row.host, row.old_flavor) == (states.ACTIVE, None, DEST, None)
    assert migration_row(resized.migration_uuid).status == "confirmed"
    assert placement.get_allocations(resized.migration_uuid) == {}
    assert attachments(resized.instance_uuid) == {DEST: "attached"}
    assert volume_status(volume_id) == "in-use"
    assert events(resized.instance_uuid) == {confirm_resize.EVENT_CONFIRM: "Success", va.EVENT_ATTACH: "Success"}


def test_a_revert_accepted_while_an_attach_checks_the_server_wins_and_the_attach_is_refused(
        started, monkeypatch, tmp_path):
    # The revert takes the task with the migration, so the attach cannot take the server after it.
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    accepted = accepted_between_check_and_take("revert", resized, monkeypatch)

    with pytest.raises(errors.InstanceInvalidState):
        va.begin_attach(owner(), location(resized), volume_id)

    [revert] = accepted
    assert volume_status(volume_id) == "available" and attachments(resized.instance_uuid) == {}
    assert started.payloads == []
    assert revert_resize.check_resize_to_revert(revert)["dest"]["host"] == DEST


def test_an_attach_whose_cell_records_fail_after_its_volume_records_frees_the_volume(started, monkeypatch,
                                                                                    tmp_path):
    # GIVEN an attach done on the host whose FinishVolumeOperation committed the volume's records
    # (attachment attached, volume in-use) but not the cell's, through all its retries
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    failed = finish_with_the_cell_unreachable(done_at_host(started.payloads[0]), monkeypatch)
    assert volume_status(volume_id) == va.IN_USE

    # WHEN the rollback tail runs (delivered twice)
    va.fail_volume_operation(failed)
    va.fail_volume_operation(failed)

    # THEN nothing of the attach is left and the volume is free for another server
    assert_attach_left_nothing(resized.instance_uuid, volume_id, tmp_path)


def test_a_failed_attach_delivered_again_leaves_alone_a_volume_another_server_now_holds(started, tmp_path):
    # GIVEN a failed attach rolled back, and the volume then attached to another server
    resized, other = make_resized(state_dir=tmp_path), make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    failed = {**done_at_host(started.payloads[0]), "error": {"Error": "Ferry.HypervisorError", "Cause": "busy"}}
    va.fail_volume_operation(failed)
    va.begin_attach(owner(), location(other), volume_id)
    run_attach(started.payloads[1])

    # WHEN the first attach's rollback tail is delivered again
    va.fail_volume_operation(failed)

    # THEN the other server keeps the volume
    assert volume_status(volume_id) == va.IN_USE
    assert attachments(other.instance_uuid) == {DEST: "attached", SOURCE: "reserved"}


def test_a_failed_attach_delivered_again_after_the_same_volume_is_attached_again_leaves_that_attach_alone(
        started, tmp_path):
    # GIVEN a failed attach rolled back, and the owner attaching the same volume to the server again,
    # its host already done
    resized = make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), volume_id)
    failed = {**done_at_host(started.payloads[0]), "error": {"Error": "Ferry.HypervisorError", "Cause": "busy"}}
    va.fail_volume_operation(failed)
    va.begin_attach(owner(), location(resized), volume_id)
    again = done_at_host(started.payloads[1])

    # WHEN the first attach's rollback tail is delivered again, and then the second attach finishes
    va.fail_volume_operation(failed)
    va.finish_volume_operation(again)

    # THEN the volume is attached to the server, once, with its mapping; one fault, the first attach's
    assert volume_status(volume_id) == va.IN_USE
    assert attachments(resized.instance_uuid) == {DEST: "attached", SOURCE: "reserved"}
    assert (volume_id, False) in bdms(resized.instance_uuid)
    assert instance_row(resized.instance_uuid).task_state is None
    assert len(faults(resized.instance_uuid)) == 1


def test_a_finished_attach_delivered_again_leaves_alone_the_attach_of_another_volume_accepted_since(
        started, tmp_path):
    # GIVEN an attach finished, and an attach of another volume to the server accepted since
    resized = make_resized(state_dir=tmp_path)
    first, second = make_volume(tmp_path), make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), first)
    done = run_attach(started.payloads[0])
    va.begin_attach(owner(), location(resized), second)

    # WHEN the first attach's last step is delivered again
    va.finish_volume_operation(done)

    # THEN the second attach keeps the server's task, and goes on to finish
    assert instance_row(resized.instance_uuid).task_state == va.ATTACHING_VOLUME
    va.finish_volume_operation(done_at_host(started.payloads[1]))
    assert (volume_status(first), volume_status(second)) == (va.IN_USE, va.IN_USE)


def test_an_attach_overtaken_after_a_reset_still_records_its_volume_and_leaves_the_newer_request_its_task(
        started, tmp_path):
    # GIVEN an attach done at its host, whose server an admin reset (task cleared) and the owner then
    # asked to attach another volume
    resized = make_resized(state_dir=tmp_path)
    first, second = make_volume(tmp_path), make_volume(tmp_path)
    va.begin_attach(owner(), location(resized), first)
    done = done_at_host(started.payloads[0])
    set_instance(resized.instance_uuid, task_state=None)
    va.begin_attach(owner(), location(resized), second)

    # WHEN the first attach's last step runs
    va.finish_volume_operation(done)

    # THEN its volume is recorded attached (its host attached it), and the newer attach keeps the task
    assert volume_status(first) == va.IN_USE
    assert instance_row(resized.instance_uuid).task_state == va.ATTACHING_VOLUME
    assert events(resized.instance_uuid)[va.EVENT_ATTACH] is None
    va.finish_volume_operation(done_at_host(started.payloads[1]))
    assert volume_status(second) == va.IN_USE and instance_row(resized.instance_uuid).task_state is None


@pytest.mark.parametrize("step", ["finish", "fail"])
def test_a_detach_step_delivered_again_after_the_volume_is_attached_again_leaves_the_attach_alone(
        started, tmp_path, step):
    # GIVEN a detach that ended (done, or failed), and the volume then attached to the server again
    resized = make_resized(volume=True, state_dir=tmp_path)
    volume_id = str(resized.volume_id)
    va.begin_detach(owner(), location(resized), volume_id)
    detach = done_at_host(started.payloads[0])
    if step == "finish":
        va.finish_volume_operation(detach)
    else:
        detach = {**detach, "error": {"Error": "Ferry.HypervisorError", "Cause": "stuck"}}
        del detach["detached"]
        va.fail_volume_operation(detach)
        va.begin_detach(owner(), location(resized), volume_id)
        va.finish_volume_operation(done_at_host(started.payloads[1]))
    va.begin_attach(owner(), location(resized), volume_id)

    # WHEN the detach's step is delivered again
    (va.finish_volume_operation if step == "finish" else va.fail_volume_operation)(detach)

    # THEN the attach keeps its reservation and its task, and finishes
    assert volume_status(volume_id) == va.ATTACHING
    assert instance_row(resized.instance_uuid).task_state == va.ATTACHING_VOLUME
    va.finish_volume_operation(done_at_host(started.payloads[-1]))
    assert volume_status(volume_id) == va.IN_USE
    assert instance_row(resized.instance_uuid).task_state is None


def test_a_detach_whose_cell_records_fail_after_its_volume_records_deletes_the_mapping(started, monkeypatch,
                                                                                      tmp_path):
    # GIVEN a detach done on the host whose FinishVolumeOperation committed the volume's records
    # (attachments gone, volume available) but not the cell's, through all its retries
    resized = make_resized(volume=True, state_dir=tmp_path)
    volume_id = resized.volume_id
    assert volume_id is not None
    va.begin_detach(owner(), location(resized), volume_id)
    failed = finish_with_the_cell_unreachable(done_at_host(started.payloads[0]), monkeypatch)
    assert (volume_status(volume_id), attachments(resized.instance_uuid)) == (va.AVAILABLE, {})

    # WHEN the rollback tail runs (delivered twice)
    va.fail_volume_operation(failed)
    va.fail_volume_operation(failed)

    # THEN the server no longer lists the volume: the mapping follows the records (the host did detach it)
    assert bdms(resized.instance_uuid) == [(volume_id, True)]
    assert va.list_attachments(location(resized)) == []
    assert volume_status(volume_id) == va.AVAILABLE
    assert instance_row(resized.instance_uuid).task_state is None
    [fault] = faults(resized.instance_uuid)
    assert "mapping is removed" in str(fault.details)
    # and once another server holds the volume, the first cannot detach it from under that server
    other = make_resized(state_dir=tmp_path)
    va.begin_attach(owner(), location(other), volume_id)
    run_attach(started.payloads[1])
    with pytest.raises(errors.VolumeNotAttached):
        va.begin_detach(owner(), location(resized), volume_id)
    assert volume_status(volume_id) == va.IN_USE


def test_an_attach_is_refused_while_a_server_holds_the_volume_whatever_its_status(started, tmp_path):
    # GIVEN a volume recorded available that another server's attachment still holds
    resized, holder = make_resized(state_dir=tmp_path), make_resized(state_dir=tmp_path)
    volume_id = make_volume(tmp_path)
    hold(volume_id, holder.instance_uuid)

    with pytest.raises(errors.VolumeInUse):
        va.begin_attach(owner(), location(resized), volume_id)

    assert volume_status(volume_id) == va.AVAILABLE
    assert attachments(resized.instance_uuid) == {} and bdms(resized.instance_uuid) == []
    assert instance_row(resized.instance_uuid).task_state is None
    assert started.payloads == []


def test_a_detach_leaves_the_volume_in_use_while_another_server_still_holds_it(started, tmp_path):
    # GIVEN a detach under way, and another server's attachment holding the volume too
    resized, holder = make_resized(volume=True, state_dir=tmp_path), make_resized(state_dir=tmp_path)
    volume_id = resized.volume_id
    assert volume_id is not None
    va.begin_detach(owner(), location(resized), volume_id)
    hold(volume_id, holder.instance_uuid)

    run_attach(started.payloads[0])

    assert attachments(resized.instance_uuid) == {}
    assert attachments(holder.instance_uuid) == {DEST: "attached"}
    assert volume_status(volume_id) == va.IN_USE


@pytest.mark.parametrize("operation", [va.ATTACH, va.DETACH])
def test_an_operation_whose_last_step_failed_after_it_committed_stands(started, tmp_path, operation):
    # GIVEN an attach or detach whose FinishVolumeOperation committed and then failed (its response lost)
    resized = make_resized(volume=operation == va.DETACH, state_dir=tmp_path)
    volume_id = ask(operation, resized, tmp_path)
    event = done_at_host(started.payloads[0])
    va.finish_volume_operation(event)
    failed = {**event, "error": {"Error": "Sandbox.Timedout", "Cause": "Task timed out after 30.00 seconds"}}

    # WHEN CheckVolumeCommitted reads it (delivered twice)
    va.check_volume_committed(failed)

    # THEN the operation stands: nothing to roll back, the records untouched
    assert va.check_volume_committed(failed) == {"committed": True}
    assert volume_status(volume_id) == (va.IN_USE if operation == va.ATTACH else va.AVAILABLE)
    assert events(resized.instance_uuid) == {va._EVENT[operation]: "Success"}


@pytest.mark.parametrize("operation", [va.ATTACH, va.DETACH])
def test_an_operation_whose_cell_records_never_committed_is_rolled_back(started, monkeypatch, tmp_path, operation):
    # GIVEN an attach or detach whose FinishVolumeOperation committed at most the volume's records
    resized = make_resized(volume=operation == va.DETACH, state_dir=tmp_path)
    ask(operation, resized, tmp_path)
    event = done_at_host(started.payloads[0])
    assert va.check_volume_committed({**event, "error": {"Error": "States.Timeout"}}) == {"committed": False}
    failed = finish_with_the_cell_unreachable(event, monkeypatch)

    # WHEN CheckVolumeCommitted reads it
    # THEN it was not committed: the rollback runs
    assert va.check_volume_committed(failed) == {"committed": False}
    assert instance_row(resized.instance_uuid).task_state == va._TASK_STATE[operation]
