"""The boot, delete and power workflow steps against a real store (SQLite and PostgreSQL).

Each test drives the step functions the way the state machine would, with moto for SQS
(host queues) and S3 (images).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from contextlib import contextmanager

import pytest
from lock_support import looked_at_while_releasing
from moto import mock_aws
from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError

from ferry import aws, config, errors, hosts, placement, protocol
from ferry.auth import RequestContext
from ferry.compute import actions, admin_actions, states
from ferry.compute import api as compute_api
from ferry.store.api_models import (
    BuildRequest,
    InstanceMapping,
    Network,
    Port,
    PortBinding,
    RequestSpec,
    Volume,
    VolumeAttachment,
    utcnow,
)
from ferry.store.cell_models import (
    BlockDeviceMapping,
    Instance,
    InstanceAction,
    InstanceActionEvent,
    InstanceFault,
    Service,
)
from ferry.store.db import api_session, cell_session
from ferry.workflows import boot, delete, power

FLAVOR = {"flavorid": "2", "name": "ferry.small", "vcpus": 2, "memory_mb": 1024, "root_gb": 2,
          "ephemeral_gb": 0, "swap": 0, "extra_specs": {}}
HOSTS = {"cell1-host1": "cell1", "cell1-host2": "cell1"}
IMAGE_BYTES = b"ferry-test-image" * 4096


@pytest.fixture
def cloud(aws_test_credentials, store):
    """A store with two reporting hosts in cell1, their queues, and an image in S3."""
    with mock_aws():
        aws.reset()
        hosts._queue_urls.clear()
        s3 = aws.client("s3")
        s3.create_bucket(Bucket=config.get().image_bucket)
        image_id = str(uuid.uuid4())
        s3.put_object(Bucket=config.get().image_bucket, Key=f"images/{image_id}", Body=IMAGE_BYTES,
                      Metadata={"image-id": image_id, "name": "test-image", "disk-format": "raw",
                                "container-format": "bare", "sha256": hashlib.sha256(IMAGE_BYTES).hexdigest()})
        for host, cell in HOSTS.items():
            aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, host))
            report(host, cell, vcpus=4, memory_mb=4096, disk_gb=20)
        with api_session() as session:
            session.add(Network(name="shared", cidr="10.0.0.0/24"))
        yield {"image_id": image_id}
        aws.reset()


def report(host: str, cell: str, *, vcpus: int, memory_mb: int, disk_gb: int) -> None:
    sent = utcnow().isoformat()
    hosts.apply_report({"kind": "inventory", "host": host, "node": host, "cell": cell, "sent_at": sent,
                        "inventory": {"VCPU": {"total": vcpus}, "MEMORY_MB": {"total": memory_mb},
                                      "DISK_GB": {"total": disk_gb}}})


def accept_server(image_id: str, flavor: dict | None = None, project: str = "demo") -> dict:
    """What the API writes for a new server: mapping, build request, request spec, one port."""
    instance_uuid = str(uuid.uuid4())
    flavor = flavor or FLAVOR
    with api_session() as session:
        network = session.scalars(select(Network)).first()
        session.add(InstanceMapping(instance_uuid=instance_uuid, project_id=project, user_id="u1"))
        session.add(BuildRequest(instance_uuid=instance_uuid, project_id=project, instance={
            "display_name": "vm1", "project_id": project, "user_id": "u1", "image_ref": image_id,
            "flavor": flavor, "vm_state": states.BUILDING, "task_state": states.SCHEDULING, "power_state": 0,
            "metadata": {"role": "test"}}, tags=["blue"]))
        session.add(RequestSpec(instance_uuid=instance_uuid, spec={
            "instance_uuid": instance_uuid, "project_id": project, "user_id": "u1", "flavor": flavor,
            "image": {"id": image_id}, "is_bfv": False, "ignore_hosts": [], "requested_destination": None,
            "allowed_cells": None, "scheduler_hints": {}, "group": None}))
        session.add(Port(network_id=network.id, project_id=project, device_id=instance_uuid,
                         mac_address="fa:16:3e:00:00:%02x" % (len(instance_uuid) % 256), fixed_ip="10.0.0.5"))
    return {"instance_uuid": instance_uuid, "request_id": f"req-{uuid.uuid4()}", "execution_name": "boot-x"}


def used_on(host: str) -> dict[str, int]:
    return placement.usages(placement.provider_by_host(host))


def test_select_destinations_claims_host_and_moves_instance_into_its_cell(cloud):
    event = accept_server(cloud["image_id"])
    dest = boot.select_destinations(event)

    assert dest["host"] in HOSTS and dest["cell"] == "cell1"
    assert dest["queue_url"].endswith(protocol.host_queue_name(config.get().host_queue_prefix, dest["host"]))
    assert len(dest["alternates"]) == 1
    assert used_on(dest["host"]) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}
    with api_session() as session:
        assert session.scalars(select(BuildRequest)).first() is None
        assert session.scalars(select(InstanceMapping)).one().cell.name == "cell1"
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        assert (instance.host, instance.task_state, instance.metadata_items) == (dest["host"], "scheduling",
                                                                                 {"role": "test"})


@pytest.mark.parametrize("fits", [True, False], ids=["scheduled", "buried-in-cell0"])
def test_the_server_keeps_the_creation_time_of_its_build_request(cloud, fits):
    # GIVEN a server accepted an hour before it is scheduled
    event = accept_server(cloud["image_id"], flavor=None if fits else {**FLAVOR, "vcpus": 64})
    accepted = (utcnow() - dt.timedelta(hours=1)).replace(microsecond=0)
    with api_session() as session:
        session.execute(update(BuildRequest).values(created_at=accepted))

    # WHEN it is handed to its cell (or buried in cell0)
    if fits:
        boot.select_destinations(event)
    else:
        boot.fail_build({**event, "error": {"Error": "Ferry.NoValidHost", "Cause": "No valid host was found."}})

    # THEN its instance was created when the server was, not when it was scheduled
    assert _instance(event["instance_uuid"], "cell1" if fits else "cell0").created_at == accepted


def test_select_destinations_run_twice_claims_once(cloud):
    event = accept_server(cloud["image_id"])
    first = boot.select_destinations(event)
    second = boot.select_destinations(event)

    assert second["host"] == first["host"]
    assert used_on(first["host"]) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}
    with cell_session("cell1") as session:
        assert len(session.scalars(select(Instance)).all()) == 1
    # the second run lists the alternates again, for a reschedule
    assert first["alternates"] and second["alternates"] == first["alternates"]


def test_no_valid_host_buries_the_server_in_cell0_without_allocations(cloud):
    event = accept_server(cloud["image_id"], flavor={**FLAVOR, "vcpus": 64})
    with pytest.raises(errors.NoValidHost) as raised:
        boot.select_destinations(event)

    boot.fail_build({**event, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}})

    assert placement.get_allocations(event["instance_uuid"]) == {}
    with api_session() as session:
        assert session.scalars(select(InstanceMapping)).one().cell.name == "cell0"
        assert session.scalars(select(BuildRequest)).first() is None
    with cell_session("cell0") as session:
        instance = session.scalars(select(Instance)).one()
        fault = session.scalars(select(InstanceFault)).one()
    assert (instance.vm_state, instance.task_state) == ("error", None)
    assert fault.message.startswith("No valid host was found")
    with cell_session("cell0") as session:
        assert session.scalars(select(InstanceActionEvent.details)).one().startswith("NoValidHost: No valid host")


def owner_brings_a_port(event: dict) -> tuple[str, str]:
    """Make the server's one port a port its owner brought, and give it a port Ferry made too:
    ``(brought, made)``, their ids."""
    with api_session() as session:
        brought = session.scalars(select(Port).where(Port.device_id == event["instance_uuid"])).one()
        made = Port(network_id=brought.network_id, project_id=brought.project_id, device_id=event["instance_uuid"],
                    mac_address="fa:16:3e:00:01:01", fixed_ip="10.0.0.6")
        session.add(made)
        session.flush()
        spec = session.scalars(select(RequestSpec).where(RequestSpec.instance_uuid == event["instance_uuid"])).one()
        spec.spec = {**spec.spec, "requested_networks": [
            {"network_id": brought.network_id, "port_id": brought.id, "preexisting": True},
            {"network_id": made.network_id, "port_id": made.id, "preexisting": False}]}
        return brought.id, made.id


def assert_network_released(instance_uuid: str, brought: str, made: str) -> None:
    """The port Ferry made is gone; the one the owner brought is the owner's again, bound nowhere."""
    with api_session() as session:
        assert session.scalars(select(Port).where(Port.device_id == instance_uuid)).all() == []
        assert session.get(Port, made) is None
        kept = session.get(Port, brought)
        assert (kept.device_id, kept.status, kept.bindings) == (None, "DOWN", [])


def test_a_server_buried_in_cell0_gives_back_its_ports_and_can_still_be_deleted(cloud):
    # GIVEN a server no host fits, with a port its owner brought and one Ferry made for it
    event = accept_server(cloud["image_id"], flavor={**FLAVOR, "vcpus": 64})
    brought, made = owner_brings_a_port(event)
    with pytest.raises(errors.NoValidHost) as raised:
        boot.select_destinations(event)
    failed = {**event, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}}

    # WHEN FailBuild buries it (delivered twice)
    boot.fail_build(failed)
    boot.fail_build(failed)

    # THEN its networking is released as Nova deallocates a failed build's
    assert_network_released(event["instance_uuid"], brought, made)
    # AND the server in ERROR is still deleted as any
    delete.finish_delete({"instance_uuid": event["instance_uuid"], "request_id": "req-del", "cell": "cell0"})
    assert _instance(event["instance_uuid"], "cell0").deleted
    # AND the port its owner brought outlives that delete, free, as the one Ferry made does not
    with api_session() as session:
        kept = session.get(Port, brought)
        assert kept is not None and kept.device_id is None
        assert session.scalars(select(Port).where(Port.device_id == event["instance_uuid"])).all() == []


def test_a_failed_build_gives_back_its_claim_and_ports_without_holding_its_cell(cloud, store, monkeypatch):
    # GIVEN a server scheduled to cell1 whose spawn failed
    event = accept_server(cloud["image_id"])
    brought, made = owner_brings_a_port(event)
    boot.select_destinations(event)
    open_meanwhile = looked_at_while_releasing(monkeypatch, store.cells["cell1"])

    # WHEN FailBuild runs
    boot.fail_build({**event, "error": {"Error": "Ferry.HypervisorError", "Cause": "spawn failed"}})

    # THEN it gave back the claim and the ports while the cell stayed open to other writers (a
    # step holding the API database may wait for the cell; SQLite has one writer per file), and
    # the server is in ERROR
    assert open_meanwhile == [True]
    assert placement.get_allocations(event["instance_uuid"]) == {}
    assert_network_released(event["instance_uuid"], brought, made)
    assert _instance(event["instance_uuid"], "cell1").vm_state == states.ERROR


def test_a_burial_cut_short_after_the_hand_over_gives_back_the_ports_when_run_again(cloud, monkeypatch):
    # GIVEN FailBuild buried the server in cell0, then lost the API database before releasing its ports
    event = accept_server(cloud["image_id"])
    brought, made = owner_brings_a_port(event)
    failed = {**event, "error": {"Error": "Ferry.NoValidHost", "Cause": "No valid host was found."}}
    with monkeypatch.context() as patched:
        def api_down(*args):  # type: ignore[no-untyped-def]
            raise OperationalError("DELETE FROM ports", {}, Exception("connection reset"))

        patched.setattr(boot.network, "release_ports", api_down)
        with pytest.raises(OperationalError):
            boot.fail_build(failed)
    assert _instance(event["instance_uuid"], "cell0").vm_state == states.ERROR

    # WHEN Step Functions runs it again, THEN the ports are given back
    boot.fail_build(failed)
    assert_network_released(event["instance_uuid"], brought, made)


def test_a_burial_in_cell0_cut_short_and_run_again_records_one_fault(cloud, monkeypatch):
    # GIVEN FailBuild recorded the fault in cell0, then lost the API database before handing the server over
    event = accept_server(cloud["image_id"])
    failed = {**event, "error": {"Error": "Ferry.NoValidHost", "Cause": "No valid host was found."}}
    with monkeypatch.context() as patched:
        patched.setattr(boot, "_hand_over", lambda *args: (_ for _ in ()).throw(OperationalError("UPDATE", {}, None)))
        with pytest.raises(OperationalError):
            boot.fail_build(failed)

    # WHEN Step Functions runs it again
    boot.fail_build(failed)

    # THEN the server is buried with one fault
    with api_session() as session:
        assert session.scalars(select(InstanceMapping)).one().cell.name == "cell0"
    with cell_session("cell0") as session:
        assert len(list(session.scalars(select(InstanceFault)))) == 1


def test_a_build_failed_before_scheduling_for_another_reason_is_buried_with_that_error(cloud):
    event = accept_server(cloud["image_id"])

    boot.fail_build({**event, "error": {"Error": "OperationalError", "Cause": "cell database unreachable"}})

    with cell_session("cell0") as session:
        assert session.scalars(select(InstanceActionEvent.details)).one() == (
            "OperationalError: cell database unreachable")


def test_server_deleted_before_scheduling_is_abandoned_without_claim(cloud):
    event = accept_server(cloud["image_id"])
    with api_session() as session:
        session.query(BuildRequest).delete()
        session.query(RequestSpec).delete()

    assert boot.select_destinations(event) == {"abandoned": True}
    assert placement.get_allocations(event["instance_uuid"]) == {}


def test_bind_then_unbind_leaves_no_port_binding(cloud):
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    guest = boot.bind_resources_at_dest(event)

    args = guest["spawn_args"]
    protocol.validate(args, protocol.SPAWN_ARGS_SCHEMA)
    assert args["image"]["id"] == cloud["image_id"] and args["flavor"]["vcpus"] == 2
    with api_session() as session:
        port = session.scalars(select(Port)).one()
        assert [(b.host, b.status) for b in port.bindings] == [(event["destination"]["host"], "ACTIVE")]
    boot.bind_resources_at_dest(event)  # a retried step adds nothing
    boot.unbind_resources_at_dest(event)
    with api_session() as session:
        assert session.scalars(select(Port)).one().bindings == []


def test_the_guest_gets_its_ports_in_the_order_the_server_was_created_with(cloud):
    # GIVEN a server created with a new port on a network, then a port its owner made earlier
    event = accept_server(cloud["image_id"])
    with api_session() as session:
        made = session.scalars(select(Port).where(Port.device_id == event["instance_uuid"])).one()
        brought = Port(network_id=made.network_id, project_id=made.project_id, device_id=event["instance_uuid"],
                       mac_address="fa:16:3e:00:00:01", created_at=made.created_at - dt.timedelta(days=1))
        session.add(brought)
        session.flush()
        spec = session.scalars(select(RequestSpec)).one()
        spec.spec = {**spec.spec, "requested_networks": [
            {"network_id": made.network_id, "port_id": made.id, "preexisting": False},
            {"network_id": made.network_id, "port_id": brought.id, "preexisting": True}]}
        order = [made.id, brought.id]
    event["destination"] = boot.select_destinations(event)

    # WHEN the build binds them, THEN its guest has them as asked, not oldest first
    assert [p["id"] for p in boot.bind_resources_at_dest(event)["spawn_args"]["ports"]] == order


def test_finish_build_marks_active_and_records_the_build_event(cloud):
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    event["spawn"] = {"power_state": states.RUNNING}
    boot.finish_build(event)
    boot.finish_build(event)

    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        events = {e.event: e.result for e in session.scalars(select(InstanceActionEvent))}
        action = session.scalars(select(InstanceAction)).one()
    assert (instance.vm_state, instance.task_state, instance.power_state) == ("active", None, 1)
    assert action.action == "create"
    assert events == {boot.EVENT_SCHEDULE: "Success", boot.EVENT_BUILD: "Success"}


@pytest.mark.parametrize("cleaned", [True, False])
def test_failed_spawn_sets_error_and_releases_the_claim_unless_the_guest_may_remain(cloud, cleaned):
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    claim = placement.get_allocations(event["instance_uuid"])
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}
    if not cleaned:
        event["cleanup_error"] = {"Error": "States.Timeout", "Cause": ""}
    boot.fail_build(event)

    # A destination not cleaned up may still run the guest: the server keeps its claim there
    assert placement.get_allocations(event["instance_uuid"]) == ({} if cleaned else claim)
    assert (used_on(event["destination"]["host"]) == {}) is cleaned
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        fault = session.scalars(select(InstanceFault)).one()
    assert (instance.vm_state, instance.task_state) == ("error", None)
    # the owner reads the error's name; the host's words are the admin's, after what is left where
    assert (fault.message, fault.details.endswith("Cause: disk full")) == ("Ferry.SpawnFailed", True)
    assert cleaned or fault.details.startswith(f"Cleanup on host {event['destination']['host']} failed")


def test_a_build_whose_spawn_failed_on_every_host_gives_back_its_ports_and_can_still_be_deleted(cloud):
    # GIVEN a server with a port its owner brought and one Ferry made, whose spawn failed and was rolled back
    event = accept_server(cloud["image_id"])
    brought, made = owner_brings_a_port(event)
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    boot.unbind_resources_at_dest(event)
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}

    # WHEN FailBuild runs (delivered twice)
    boot.fail_build(event)
    boot.fail_build(event)

    # THEN the server is in ERROR and its networking is released: the owner may boot again with the port
    assert _instance(event["instance_uuid"]).vm_state == states.ERROR
    assert_network_released(event["instance_uuid"], brought, made)
    # AND the server is still deleted as any
    delete.finish_delete({"instance_uuid": event["instance_uuid"], "request_id": "req-del", "cell": "cell1"})
    assert _instance(event["instance_uuid"]).deleted


def test_a_failed_spawn_whose_guest_may_remain_keeps_its_ports_with_its_claim(cloud):
    # GIVEN a failed spawn whose destination could not be cleaned up: the guest may still run there
    event = _spawned(cloud["image_id"])
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}
    event["cleanup_error"] = {"Error": "States.Timeout", "Cause": ""}
    # ... nor its ports and volumes unbound from it
    event["unbind_error"] = {"Error": "OperationalError", "Cause": "API database unreachable"}

    boot.fail_build(event)

    # THEN its ports stay with it, as its claim does, until its delete releases them, and the
    # fault's details say so
    with api_session() as session:
        assert len(session.scalars(select(Port).where(Port.device_id == event["instance_uuid"])).all()) == 1
    with cell_session("cell1") as session:
        fault = session.scalars(select(InstanceFault)).one()
    assert "its ports and volumes stay bound there until the server is deleted" in fault.details


def test_a_failed_spawn_whose_destination_was_cleaned_but_not_unbound_releases_the_claim_and_says_so(cloud):
    # GIVEN a failed spawn whose guest DestroyAtDest removed, and whose UnbindResourcesAtDest failed for good
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}
    event["unbind_error"] = {"Error": "OperationalError", "Cause": "API database unreachable"}

    boot.fail_build(event)

    # THEN no guest is left to hold the claim: it is released; the fault names the bindings left, not a guest
    assert placement.get_allocations(event["instance_uuid"]) == {}
    with cell_session("cell1") as session:
        fault = session.scalars(select(InstanceFault)).one()
    assert "Unbinding its ports and volumes from host" in fault.details
    assert "API database unreachable" in fault.details and "guest" not in fault.details
    assert "its volumes stay attached there" in fault.details and "ports and volumes stay" not in fault.details


def test_reschedule_moves_the_claim_to_the_alternate(cloud):
    event = accept_server(cloud["image_id"])
    first = boot.select_destinations(event)
    event["destination"] = first
    boot.bind_resources_at_dest(event)
    boot.unbind_resources_at_dest(event)

    second = boot.reschedule_build(event)

    assert second["host"] != first["host"] and second["alternates"] == []
    assert used_on(first["host"]) == {}
    assert used_on(second["host"]) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}


def test_finish_delete_releases_everything_and_is_idempotent(cloud):
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    event["spawn"] = {"power_state": 1}
    boot.finish_build(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.DELETING))
    delete_event = {"instance_uuid": event["instance_uuid"], "request_id": "req-del", "cell": "cell1",
                    "host": event["destination"]["host"]}

    delete.finish_delete(delete_event)
    delete.finish_delete(delete_event)

    assert used_on(event["destination"]["host"]) == {}
    with api_session() as session:
        assert session.scalars(select(Port)).first() is None
        assert session.scalars(select(InstanceMapping)).one().queued_for_delete is True
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
    assert (instance.vm_state, instance.deleted, instance.task_state) == ("deleted", True, None)


def test_finish_delete_unplugs_a_port_the_owner_brought_and_keeps_it(cloud):
    event = accept_server(cloud["image_id"])
    with api_session() as session:
        port = session.scalars(select(Port).where(Port.device_id == event["instance_uuid"])).one()
        spec = session.scalars(select(RequestSpec)).one()
        spec.spec = {**spec.spec, "requested_networks": [
            {"network_id": port.network_id, "port_id": port.id, "preexisting": True}]}
        port_id = port.id
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    event["spawn"] = {"power_state": 1}
    boot.finish_build(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.DELETING))

    delete.finish_delete({"instance_uuid": event["instance_uuid"], "request_id": "req-del", "cell": "cell1",
                          "host": event["destination"]["host"]})

    with api_session() as session:
        kept = session.get(Port, port_id)
        assert (kept.device_id, kept.status, kept.bindings) == (None, "DOWN", [])


def test_fail_delete_sets_error_and_clears_the_task(cloud):
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.DELETING, vm_state="active"))

    delete.fail_delete({"instance_uuid": event["instance_uuid"], "request_id": "r", "cell": "cell1",
                        "host": "cell1-host1", "error": {"Error": "Ferry.HypervisorError", "Cause": "boom"}})

    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        fault = session.scalars(select(InstanceFault)).one()
        assert (fault.message, fault.details) == ("Ferry.HypervisorError", "Cause: boom")
    assert (instance.vm_state, instance.task_state) == ("error", None)
    assert placement.get_allocations(event["instance_uuid"]) != {}


def test_a_delete_that_failed_after_releasing_its_server_is_finished_not_left_in_error(cloud, monkeypatch):
    # GIVEN a delete whose FinishDelete released the server in the API database (mapping queued
    # for delete) and then failed in the cell, after its retries
    event = accept_server(cloud["image_id"])
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    event["spawn"] = {"power_state": 1}
    boot.finish_build(event)
    uuid = event["instance_uuid"]
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.DELETING))
        actions.start_action(session, instance_uuid=uuid, action=actions.DELETE, request_id="r-del",
                             user_id="u1", project_id="demo")
    step = {"instance_uuid": uuid, "request_id": "r-del", "cell": "cell1", "host": event["destination"]["host"]}
    mark_deleted = delete._mark_deleted

    def cell_unreachable(_event):
        raise RuntimeError("cell database unreachable")

    monkeypatch.setattr(delete, "_mark_deleted", cell_unreachable)
    with pytest.raises(RuntimeError):
        delete.finish_delete(step)
    monkeypatch.setattr(delete, "_mark_deleted", mark_deleted)

    # WHEN FailDelete runs (twice: a step may run again)
    failed = {**step, "error": {"Error": "RuntimeError", "Cause": "cell database unreachable"}}
    assert delete.fail_delete(failed) == delete.fail_delete(failed) == {"finished": True}

    # THEN the delete is finished: the server deleted, no fault, nothing held
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        assert session.scalars(select(InstanceFault)).all() == []
    assert (instance.deleted, instance.vm_state, instance.task_state) == (True, states.DELETED, None)
    assert placement.get_allocations(uuid) == {}


def two_deletes_of_a_server_in_error(image_id: str, *, task_state: str | None, released: bool) -> str:
    """A scheduled server in ERROR with task ``task_state`` and two deletes accepted, ``r-older``
    then ``r-newer``; its mapping queued for delete when one FinishDelete ``released`` it. Its uuid."""
    event = accept_server(image_id)
    event["destination"] = boot.select_destinations(event)
    uuid = event["instance_uuid"]
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=task_state, vm_state="error"))
        for request_id in ("r-older", "r-newer"):
            actions.start_action(session, instance_uuid=uuid, action=actions.DELETE, request_id=request_id,
                                 user_id="u1", project_id="demo")
    if released:
        with api_session() as session:
            session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == uuid)
                            .values(queued_for_delete=True))
    return uuid


def test_an_older_delete_that_failed_leaves_finishing_to_the_newer_one_that_released_the_server(cloud):
    # GIVEN two deletes of a server in error, the newer one's FinishDelete having released it in
    # the API database (mapping queued for delete), and the older one failed
    uuid = two_deletes_of_a_server_in_error(cloud["image_id"], task_state=states.DELETING, released=True)

    # WHEN the older delete's FailDelete runs
    outcome = delete.fail_delete({"instance_uuid": uuid, "request_id": "r-older", "cell": "cell1",
                                  "error": {"Error": "Ferry.HypervisorError", "Cause": "boom"}})

    # THEN it finishes nothing of the server's (the newer delete does) and its execution fails
    assert outcome == {}
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
    assert (instance.deleted, instance.task_state) == (False, states.DELETING)


def test_an_older_delete_that_released_the_server_finishes_it_when_the_newer_one_ended_without(cloud):
    # GIVEN two deletes of a server in error: the newer one failed and ended (the server back in
    # ERROR, no task), then the older one's FinishDelete released the server and failed
    uuid = two_deletes_of_a_server_in_error(cloud["image_id"], task_state=None, released=True)

    # WHEN the older delete's FailDelete runs, THEN it finishes the delete: nobody else would
    outcome = delete.fail_delete({"instance_uuid": uuid, "request_id": "r-older", "cell": "cell1",
                                  "error": {"Error": "RuntimeError", "Cause": "cell database unreachable"}})

    assert outcome == {"finished": True}
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance.deleted)).one() is True


def test_a_failed_delete_leaves_the_task_of_a_newer_delete_alone(cloud):
    # GIVEN a delete that failed once its server was in error, and a second delete accepted since
    uuid = two_deletes_of_a_server_in_error(cloud["image_id"], task_state=states.DELETING, released=False)

    # WHEN the first delete's FailDelete runs (late, or again)
    delete.fail_delete({"instance_uuid": uuid, "request_id": "r-older", "cell": "cell1", "host": "cell1-host1",
                        "error": {"Error": "Ferry.HypervisorError", "Cause": "boom"}})

    # THEN the second delete keeps its task, and no second fault is written
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        assert session.scalars(select(InstanceFault)).all() == []
    assert instance.task_state == states.DELETING


@pytest.mark.parametrize(("operation", "task", "power_state", "vm_state"), [
    (protocol.POWER_OFF, states.POWERING_OFF, states.SHUTDOWN, states.STOPPED),
    (protocol.POWER_ON, states.POWERING_ON, states.RUNNING, states.ACTIVE),
])
def test_power_action_settles_vm_state_from_the_reported_power_state(cloud, operation, task, power_state,
                                                                      vm_state):
    event = accept_server(cloud["image_id"])
    boot.select_destinations(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=task))
        actions.start_action(session, instance_uuid=event["instance_uuid"], action=actions.STOP,
                             request_id="r", user_id="u1", project_id="demo")
    power_event = {"instance_uuid": event["instance_uuid"], "request_id": "r", "cell": "cell1",
                   "operation": operation, "result": {"power_state": power_state}}

    power.finish_power_action(power_event)
    power.finish_power_action(power_event)

    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
    assert (instance.vm_state, instance.task_state, instance.power_state) == (vm_state, None, power_state)


@pytest.mark.parametrize(("operation", "task", "reported", "vm_state"), [
    (protocol.POWER_OFF, states.POWERING_OFF, states.CRASHED, states.STOPPED),
    (protocol.POWER_ON, states.POWERING_ON, states.PAUSED_POWER, states.ACTIVE),
])
def test_a_finished_power_action_sets_vm_state_by_the_operation_whatever_power_state_is_reported(
        cloud, operation, task, reported, vm_state):
    # GIVEN a stop (or start) whose host reports a power state other than the expected one
    event = accept_server(cloud["image_id"])
    boot.select_destinations(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=task))
        actions.start_action(session, instance_uuid=event["instance_uuid"], action=actions.STOP,
                             request_id="r", user_id="u1", project_id="demo")

    power.finish_power_action({"instance_uuid": event["instance_uuid"], "request_id": "r", "cell": "cell1",
                               "operation": operation, "result": {"power_state": reported}})

    # THEN the server is stopped (or active) as Nova's stop and start leave it, the power state recorded
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
    assert (instance.vm_state, instance.task_state, instance.power_state) == (vm_state, None, reported)


def test_a_power_action_whose_last_step_failed_after_the_host_did_it_settles_the_server(cloud):
    # GIVEN a stop the host did (its answer in the document), whose FinishPowerAction failed for good
    event = accept_server(cloud["image_id"])
    boot.select_destinations(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.POWERING_OFF, vm_state="active"))
        actions.start_action(session, instance_uuid=event["instance_uuid"], action=actions.STOP,
                             request_id="r", user_id="u1", project_id="demo")

    power.fail_power_action({"instance_uuid": event["instance_uuid"], "request_id": "r", "cell": "cell1",
                             "operation": protocol.POWER_OFF, "result": {"power_state": states.SHUTDOWN},
                             "error": {"Error": "OperationalError", "Cause": "database went away"}})

    # THEN the server is stopped as the host left it (nothing would correct it later), the error recorded
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
    assert (instance.vm_state, instance.task_state, instance.power_state) == (
        states.STOPPED, None, states.SHUTDOWN)


@pytest.mark.parametrize("undone", [False, True])
def test_failed_power_action_keeps_vm_state_and_records_fault(cloud, undone):
    # GIVEN a stop under way; or one the API undid, the server now stopping under another request
    event = accept_server(cloud["image_id"])
    boot.select_destinations(event)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.POWERING_OFF, vm_state="active"))
        actions.start_action(session, instance_uuid=event["instance_uuid"], action=actions.STOP,
                             request_id="r-other" if undone else "r", user_id="u1", project_id="demo")

    # WHEN the stop's FailPowerAction runs
    power.fail_power_action({"instance_uuid": event["instance_uuid"], "request_id": "r", "cell": "cell1",
                             "operation": protocol.POWER_OFF,
                             "error": {"Error": "Ferry.HypervisorError", "Cause": "libvirt said no"}})

    # THEN the stop's failure is recorded; the other request's task is never touched
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        faults = [(f.message, f.details) for f in session.scalars(select(InstanceFault))]
    if undone:
        assert (instance.task_state, faults) == (states.POWERING_OFF, [])
    else:
        assert (instance.vm_state, instance.task_state, faults) == (
            "active", None, [("Ferry.HypervisorError", "Cause: libvirt said no")])


@pytest.mark.parametrize("step", ["finish", "fail"])
def test_a_power_step_run_again_after_it_committed_leaves_a_newer_stop_alone(cloud, step):
    # GIVEN a stop whose last step committed (its answer lost), and a newer stop the owner asked for since
    event = accept_server(cloud["image_id"])
    boot.select_destinations(event)
    uuid = event["instance_uuid"]
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.POWERING_OFF, vm_state="active"))
        actions.start_action(session, instance_uuid=uuid, action=actions.STOP, request_id="r1", user_id="u1",
                             project_id="demo")
    first = {"instance_uuid": uuid, "request_id": "r1", "cell": "cell1", "operation": protocol.POWER_OFF,
             "result": {"power_state": states.RUNNING}, "error": {"Error": "Ferry.HypervisorError", "Cause": "no"}}
    run = power.finish_power_action if step == "finish" else power.fail_power_action
    run(first)
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(task_state=states.POWERING_OFF, vm_state="active"))
        actions.start_action(session, instance_uuid=uuid, action=actions.STOP, request_id="r2", user_id="u1",
                             project_id="demo")
        faults = len(list(session.scalars(select(InstanceFault))))

    # WHEN Step Functions runs the first stop's step again
    run(first)

    # THEN the newer stop keeps its task, and nothing more is recorded
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        assert (instance.vm_state, instance.task_state) == ("active", states.POWERING_OFF)
        assert len(list(session.scalars(select(InstanceFault)))) == faults
    # AND a reset alone does not stop the step from recording what its host did
    with cell_session("cell1") as session:
        actions.start_action(session, instance_uuid=uuid, action=actions.RESET_STATE, request_id="r3",
                             user_id="u1", project_id="demo")
    power.finish_power_action({**first, "request_id": "r2", "result": {"power_state": states.SHUTDOWN}})
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance.vm_state)).one() == states.STOPPED


def test_a_build_whose_server_was_deleted_before_it_failed_ends_its_event(cloud):
    # GIVEN a server spawning on its host, which its owner deletes, the delete finishing first
    event = _spawned(cloud["image_id"])
    uuid = event["instance_uuid"]
    with cell_session("cell1") as session:
        session.execute(update(Instance).values(task_state=states.DELETING))
        actions.start_action(session, instance_uuid=uuid, action=actions.DELETE, request_id="req-delete",
                             user_id="u1", project_id="demo")
    removal = {"instance_uuid": uuid, "request_id": "req-delete", "cell": "cell1",
               "host": event["destination"]["host"]}
    delete.find_resize_to_confirm(removal)
    delete.finish_delete(removal)

    # WHEN the build fails and rolls back, twice
    with pytest.raises((errors.UnexpectedTaskState, errors.InstanceNotFound)):
        boot.finish_build(event)
    assert boot.check_build_committed(event) == {"committed": False}
    boot.unbind_resources_at_dest(event)
    failed = {**event, "error": {"Error": "Ferry.UnexpectedTaskState", "Cause": "deleted"}}
    boot.fail_build(failed)
    boot.fail_build(failed)

    # THEN nothing is held, and the server's create action shows how its build ended
    assert placement.get_allocations(uuid) == {}
    with cell_session("cell1") as session:
        build = session.scalars(select(InstanceActionEvent).where(
            InstanceActionEvent.event == boot.EVENT_BUILD)).one()
    assert (build.finish_time is not None, build.result) == (True, "Error")


def test_a_server_an_admin_settled_while_it_spawned_is_recorded_launched_when_finish_build_failed(cloud):
    # GIVEN a spawning server an admin reset to active, whose FinishBuild then failed before its commit
    event = _spawned(cloud["image_id"])
    uuid = event["instance_uuid"]
    admin = RequestContext(user_id="admin", project_id="admin", roles=("admin",))
    admin_actions.reset_state(admin, compute_api.locate(admin, uuid), "active")

    # WHEN CheckBuildCommitted reads it (twice)
    failed = {**event, "error": {"Error": "Ferry.DatabaseUnavailable", "Cause": "away"}}
    assert boot.check_build_committed(failed) == {"committed": True}
    assert boot.check_build_committed(failed) == {"committed": True}

    # THEN the build stands and is recorded as FinishBuild records it: launched there (a delete
    # then keeps a root volume not meant to go with it), the ports active, the event ended
    with cell_session("cell1") as session:
        instance = session.scalars(select(Instance)).one()
        build = session.scalars(select(InstanceActionEvent).where(
            InstanceActionEvent.event == boot.EVENT_BUILD)).one()
    assert (instance.launched_on, instance.vm_state) == (event["destination"]["host"], states.ACTIVE)
    assert instance.launched_at is not None and build.result == "Success"
    with api_session() as session:
        assert set(session.scalars(select(Port.status).where(Port.device_id == uuid))) <= {"ACTIVE"}


def _stop_under_way(cloud) -> tuple[str, dict]:
    """A built server whose os-stop BeginPowerAction took: ``(server, the power workflow's event)``."""
    event = _spawned(cloud["image_id"])
    boot.finish_build(event)
    uuid = event["instance_uuid"]
    with cell_session("cell1") as session:
        session.execute(update(Instance).values(task_state=states.POWERING_OFF))
        actions.start_action(session, instance_uuid=uuid, action=actions.STOP, request_id="r1",
                             user_id="u1", project_id="demo")
    stop = {"instance_uuid": uuid, "request_id": "r1", "cell": "cell1", "host": event["destination"]["host"],
            "operation": protocol.POWER_OFF}
    power.begin_power_action(stop)
    return uuid, stop


@pytest.mark.parametrize("step", ["finish", "fail"])
def test_a_power_action_whose_task_an_admin_reset_still_records_what_its_host_did(cloud, step):
    # GIVEN a stop under way, its task cleared by an admin's os-resetState (the stop looked stuck)
    uuid, stop = _stop_under_way(cloud)
    admin = RequestContext(user_id="admin", project_id="admin", roles=("admin",))
    admin_actions.reset_state(admin, compute_api.locate(admin, uuid), "active")

    # WHEN the host has stopped the guest (or failed to) and the step ends the stop
    if step == "finish":
        power.finish_power_action({**stop, "result": {"power_state": states.SHUTDOWN}})
    else:
        power.fail_power_action({**stop, "error": {"Error": "Ferry.HypervisorError", "Cause": "it broke"}})

    # THEN the stop's event ends, and the server's power state is recorded as the host left it
    # (its vm_state is the admin's)
    with cell_session("cell1") as session:
        ended = session.scalars(select(InstanceActionEvent).where(
            InstanceActionEvent.event == "compute_stop_instance")).one()
        instance = session.scalars(select(Instance)).one()
        faults = list(session.scalars(select(InstanceFault)))
    assert ended.finish_time is not None
    assert ended.result == ("Success" if step == "finish" else "Error")
    if step == "finish":
        assert (instance.vm_state, instance.power_state, instance.task_state) == (
            states.ACTIVE, states.SHUTDOWN, None)
    else:
        assert instance.task_state is None and len(faults) == 1


def test_a_power_action_a_newer_request_took_the_server_from_still_ends_its_event(cloud):
    # GIVEN a stop under way whose server an admin reset to error and its owner then deleted
    uuid, stop = _stop_under_way(cloud)
    with cell_session("cell1") as session:
        session.execute(update(Instance).values(vm_state=states.ERROR, task_state=states.DELETING))
        actions.start_action(session, instance_uuid=uuid, action=actions.DELETE, request_id="r2",
                             user_id="u1", project_id="demo")

    # WHEN the stop's step ends it
    power.finish_power_action({**stop, "result": {"power_state": states.SHUTDOWN}})

    # THEN its event ends, and the server is left to the delete
    with cell_session("cell1") as session:
        ended = session.scalars(select(InstanceActionEvent).where(
            InstanceActionEvent.event == "compute_stop_instance")).one()
        instance = session.scalars(select(Instance)).one()
    assert ended.finish_time is not None
    assert (instance.vm_state, instance.task_state) == (states.ERROR, states.DELETING)


def test_host_report_maps_new_host_and_records_heartbeat(cloud):
    report("cell2-host9", "cell2", vcpus=2, memory_mb=1024, disk_gb=10)

    assert hosts.cell_of_host("cell2-host9") == "cell2"
    with cell_session("cell2") as session:
        service = session.scalars(select(Service).where(Service.host == "cell2-host9")).one()
    assert hosts.is_up(service)
    assert not hosts.is_up(service, now=utcnow() + dt.timedelta(seconds=config.get().service_down_time + 1))


def test_host_report_without_mapping_or_cell_is_refused(cloud):
    with pytest.raises(errors.HostNotMapped):
        hosts.apply_report({"kind": "heartbeat", "host": "stray", "sent_at": utcnow().isoformat()})


def _rename_build_request(instance_uuid: str, name: str) -> None:
    ctx = RequestContext(user_id="u1", project_id="demo", roles=("member",))
    compute_api.update_server(ctx, compute_api.locate(ctx, instance_uuid), {"name": name, "description": "new"})


@pytest.mark.parametrize("no_host", [False, True])
def test_a_rename_made_while_the_server_is_handed_to_its_cell_is_not_lost(cloud, monkeypatch, no_host):
    # GIVEN the owner renames the server just after the boot workflow copied its build request
    event = accept_server(cloud["image_id"], flavor={**FLAVOR, "vcpus": 64} if no_host else None)
    copy = boot._create_in_cell

    def copy_then_rename(build, cell, request_id, **values):
        copy(build, cell, request_id, **values)
        _rename_build_request(event["instance_uuid"], "renamed")

    monkeypatch.setattr(boot, "_create_in_cell", copy_then_rename)

    # WHEN the workflow hands the server over to its cell (or buries it in cell0)
    if no_host:
        with pytest.raises(errors.NoValidHost) as raised:
            boot.select_destinations(event)
        boot.fail_build({**event, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}})
    else:
        boot.select_destinations(event)

    # THEN the instance carries the new name and description
    with cell_session("cell0" if no_host else "cell1") as session:
        instance = session.scalars(select(Instance)).one()
    assert (instance.display_name, instance.display_description) == ("renamed", "new")


def _rename_after_cell_writes(monkeypatch, instance_uuid: str, names: list[str], skip: int = 1) -> None:
    """Rename the build request after each cell session of the boot step ends, from the
    ``skip``-th on (the first is the copy into the cell), while names are left."""
    opened = boot.cell_session
    count = 0

    @contextmanager
    def renaming(cell):
        nonlocal count
        with opened(cell) as session:
            yield session
        count += 1
        if count > skip and names:
            _rename_build_request(instance_uuid, names.pop(0))

    monkeypatch.setattr(boot, "cell_session", renaming)


def test_a_hand_over_whose_build_request_changed_meanwhile_is_rolled_back_and_tried_again(cloud, monkeypatch):
    # GIVEN a rename lands between the copy getting the build request's values and the delete
    event = accept_server(cloud["image_id"])
    _rename_after_cell_writes(monkeypatch, event["instance_uuid"], ["late-rename"])

    boot.select_destinations(event)

    # THEN the first delete saw the change and was rolled back; the second carried it over
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance.display_name)).one() == "late-rename"
    with api_session() as session:
        assert session.scalars(select(BuildRequest)).first() is None
        assert session.scalars(select(InstanceMapping)).one().cell.name == "cell1"


def test_a_build_request_that_keeps_changing_is_a_retried_error_that_hands_nothing_over(cloud, monkeypatch):
    event = accept_server(cloud["image_id"])
    _rename_after_cell_writes(monkeypatch, event["instance_uuid"], [f"name-{n}" for n in range(10)])

    with pytest.raises(errors.BuildRequestChanged):
        boot.select_destinations(event)
    with api_session() as session:
        assert session.scalars(select(BuildRequest)).one() is not None
        assert session.scalars(select(InstanceMapping)).one().cell is None
    with cell_session("cell1") as session:  # no copy left behind, unmapped: a retry makes it again
        assert session.scalars(select(Instance)).first() is None
        assert session.scalars(select(InstanceAction)).first() is None


def test_a_server_deleted_while_it_is_buried_leaves_nothing_in_cell0(cloud, monkeypatch):
    event = accept_server(cloud["image_id"], flavor={**FLAVOR, "vcpus": 64})
    with pytest.raises(errors.NoValidHost) as raised:
        boot.select_destinations(event)
    copy = boot._create_in_cell

    def copy_then_delete(build, cell, request_id, **values):
        copy(build, cell, request_id, **values)
        with api_session() as session:  # what the API does to a server that is still a build request
            session.query(BuildRequest).delete()
            session.query(InstanceMapping).delete()

    monkeypatch.setattr(boot, "_create_in_cell", copy_then_delete)

    boot.fail_build({**event, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}})

    with cell_session("cell0") as session:
        assert session.scalars(select(Instance)).first() is None
        assert session.scalars(select(InstanceFault)).first() is None


def test_a_copy_never_handed_over_is_removed_when_the_server_is_buried_in_cell0(cloud, monkeypatch):
    # GIVEN every run of SelectDestinations copies the server into cell1 and then fails to hand
    # it over (its API database write breaks), until the workflow's retries run out
    event = accept_server(cloud["image_id"])

    def broken_hand_over(uuid, cell):
        raise RuntimeError("the API database went away")

    monkeypatch.setattr(boot, "_hand_over", broken_hand_over)
    for _attempt in range(2):
        with pytest.raises(RuntimeError):
            boot.select_destinations(event)
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance.uuid)).one() == event["instance_uuid"]
    monkeypatch.undo()

    # WHEN the workflow gives up and fails the build
    boot.fail_build({**event, "error": {"Error": "RuntimeError", "Cause": "the API database went away"}})

    # THEN the server is buried in cell0 alone: no copy, action or claim stays in cell1
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance)).first() is None
        assert session.scalars(select(InstanceAction)).first() is None
    with cell_session("cell0") as session:
        assert session.scalars(select(Instance.vm_state)).one() == "error"
    with api_session() as session:
        assert session.scalars(select(InstanceMapping)).one().cell.name == "cell0"
    assert placement.get_allocations(event["instance_uuid"]) == {}


def test_a_cell_that_cannot_be_reached_does_not_stop_the_burial(cloud, monkeypatch):
    event = accept_server(cloud["image_id"], flavor={**FLAVOR, "vcpus": 64})
    with pytest.raises(errors.NoValidHost) as raised:
        boot.select_destinations(event)
    remove, tried = boot._remove_unmapped_copy, []

    def cell2_down(uuid, cell):
        tried.append(cell)
        if cell == "cell2":
            raise OperationalError("connect", {}, Exception("connection refused"))
        return remove(uuid, cell)

    monkeypatch.setattr(boot, "_remove_unmapped_copy", cell2_down)

    boot.fail_build({**event, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}})

    assert sorted(tried) == ["cell1", "cell2"]
    with api_session() as session:
        assert session.scalars(select(InstanceMapping)).one().cell.name == "cell0"


# --- a FinishBuild that failed, and servers deleted while they are built ------------------------------


def _spawned(image_id: str) -> dict:
    """A server bound to its host, as FinishBuild receives it after the spawn."""
    event = accept_server(image_id)
    event["destination"] = boot.select_destinations(event)
    boot.bind_resources_at_dest(event)
    event["spawn"] = {"power_state": states.RUNNING}
    return event


def _delete_as_the_api_does(instance_uuid: str) -> None:
    """``DELETE /servers/{id}`` accepted for a server still building in its cell: task ``deleting``."""
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().where(Instance.uuid == instance_uuid)
                        .values(task_state=states.DELETING))


def _delete_unscheduled(instance_uuid: str) -> None:
    """``DELETE /servers/{id}`` for a server that is still a build request."""
    ctx = RequestContext(user_id="u1", project_id="demo", roles=("member",))
    compute_api.delete_server(ctx, compute_api.locate(ctx, instance_uuid))


def _port_states(instance_uuid: str) -> list[tuple[str, list[str]]]:
    with api_session() as session:
        return [(p.status, [b.host for b in p.bindings])
                for p in session.scalars(select(Port).where(Port.device_id == instance_uuid))]


def _instance(instance_uuid: str, cell: str = "cell1") -> Instance:
    with cell_session(cell) as session:
        return session.scalars(select(Instance).where(Instance.uuid == instance_uuid)).one()


def test_finish_build_updates_the_ports_before_the_cell_commit_so_a_failure_there_commits_nothing(cloud, monkeypatch):
    # GIVEN the API database breaks while FinishBuild marks the ports ACTIVE
    event = _spawned(cloud["image_id"])

    @contextmanager
    def api_down():
        raise OperationalError("UPDATE ports", {}, Exception("connection reset"))
        yield

    monkeypatch.setattr(boot, "api_session", api_down)
    with pytest.raises(OperationalError):
        boot.finish_build(event)

    # THEN the server is not committed ACTIVE: the failure is rolled back, not a built server destroyed
    instance = _instance(event["instance_uuid"])
    assert (instance.vm_state, instance.task_state, instance.launched_on) == (states.BUILDING, states.SPAWNING, None)
    assert boot.check_build_committed(event) == {"committed": False}

    # AND a retry, the database back, finishes the build with its ports
    monkeypatch.undo()
    boot.finish_build(event)
    instance = _instance(event["instance_uuid"])
    assert (instance.vm_state, instance.task_state) == (states.ACTIVE, None)
    assert _port_states(event["instance_uuid"]) == [("ACTIVE", [event["destination"]["host"]])]


def test_finish_build_run_again_after_a_spawn_that_reported_shutoff_changes_nothing(cloud):
    event = _spawned(cloud["image_id"])
    event["spawn"] = {"power_state": states.SHUTDOWN}
    boot.finish_build(event)

    boot.finish_build(event)  # the retry of a step whose response was lost

    instance = _instance(event["instance_uuid"])
    assert (instance.vm_state, instance.task_state, instance.power_state) == (states.STOPPED, None, states.SHUTDOWN)
    assert boot.check_build_committed(event) == {"committed": True}


@pytest.mark.parametrize("after", ["nothing", "stop", "delete"])
def test_a_build_that_committed_stays_committed_whatever_its_owner_did_since(cloud, after):
    # GIVEN FinishBuild committed, and then its invocation failed (a timeout, a lost response)
    event = _spawned(cloud["image_id"])
    boot.finish_build(event)
    # AND the owner already acted on the ACTIVE server
    if after == "stop":
        with cell_session("cell1") as session:
            session.execute(Instance.__table__.update().values(task_state=states.POWERING_OFF))
    elif after == "delete":
        _delete_as_the_api_does(event["instance_uuid"])
        delete.finish_delete({"instance_uuid": event["instance_uuid"], "request_id": "req-del", "cell": "cell1"})

    # THEN the check before the rollback says the build stands, and FinishBuild run again agrees
    assert boot.check_build_committed({**event, "error": {"Error": "Sandbox.Timedout", "Cause": ""}}) == {
        "committed": True}
    if after != "delete":
        boot.finish_build(event)


@pytest.mark.parametrize(("vm_state", "task_state"), [(states.ACTIVE, None), (states.ERROR, None),
                                                     (states.ACTIVE, states.POWERING_OFF)])
def test_a_server_an_admin_reset_while_it_spawned_keeps_its_guest(cloud, vm_state, task_state):
    # GIVEN an admin reset a server that looked stuck spawning (os-resetState: task cleared), its
    # owner maybe asked a stop since, and its spawn then succeeded
    event = _spawned(cloud["image_id"])
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(vm_state=vm_state, task_state=task_state))

    # THEN FinishBuild, or the check after it failed, lets the build stand: no rollback destroys
    # the guest under the server the admin settled
    assert boot.finish_build(event) == {}
    assert boot.check_build_committed(event) == {"committed": True}
    instance = _instance(event["instance_uuid"])
    assert (instance.vm_state, instance.task_state) == (vm_state, task_state)
    # AND it is recorded launched there, as it is (a delete keeps a root volume not meant to go with
    # a server that ran), its ports active and the build's event closed; run again, nothing changes
    assert (instance.launched_on, instance.launched_at is not None) == (event["destination"]["host"], True)
    boot.finish_build(event)
    assert _instance(event["instance_uuid"]).launched_at == instance.launched_at
    with api_session() as session:
        assert set(session.scalars(select(Port.status).where(Port.device_id == event["instance_uuid"]))) == {"ACTIVE"}
    with cell_session("cell1") as session:
        assert session.scalars(select(InstanceActionEvent.result).where(
            InstanceActionEvent.event == boot.EVENT_BUILD)).one() == "Success"


@pytest.mark.parametrize("vm_state", [states.ACTIVE, states.STOPPED])
def test_a_server_an_admin_reset_while_its_spawn_failed_ends_in_error_without_its_claim(cloud, vm_state):
    # GIVEN an admin reset a server that looked stuck spawning, and its spawn then failed (the
    # rollback destroyed what it left and unbound its ports)
    event = _spawned(cloud["image_id"])
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(vm_state=vm_state, task_state=None))
    boot.unbind_resources_at_dest(event)
    with pytest.raises(errors.UnexpectedTaskState):  # no reschedule of a server no longer building
        boot.reschedule_build(event)
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}

    # WHEN FailBuild runs (delivered twice)
    boot.fail_build(event)
    boot.fail_build(event)

    # THEN the server is in ERROR with the spawn's fault, and holds no claim
    instance = _instance(event["instance_uuid"])
    assert (instance.vm_state, instance.task_state) == (states.ERROR, None)
    assert placement.get_allocations(event["instance_uuid"]) == {}
    with cell_session("cell1") as session:
        assert [(f.message, f.details) for f in session.scalars(select(InstanceFault))] == [
            ("Ferry.SpawnFailed", "Cause: disk full")]


@pytest.mark.parametrize("host", [None, "elsewhere"])
def test_a_server_reset_off_its_builds_host_whose_spawn_failed_is_not_refused_for_good(cloud, host):
    # GIVEN an admin reset a building server that a reschedule had taken off its host (no host),
    # or that has moved to another host since; then its spawn failed
    event = _spawned(cloud["image_id"])
    with cell_session("cell1") as session:
        session.execute(Instance.__table__.update().values(vm_state=states.ACTIVE, task_state=None, host=host))
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}

    claim = placement.get_allocations(event["instance_uuid"])
    assert claim

    # WHEN FailBuild runs, THEN it ends (no retries into RollbackFailed): a server with no host is
    # in ERROR without its claim, one that moved on is left as it is, with the claim it holds
    boot.fail_build(event)
    assert _instance(event["instance_uuid"]).vm_state == (states.ERROR if host is None else states.ACTIVE)
    assert placement.get_allocations(event["instance_uuid"]) == ({} if host is None else claim)


def test_a_late_finish_build_for_a_host_the_build_was_rescheduled_from_commits_nothing(cloud):
    # GIVEN the build was rescheduled to another host while a run of FinishBuild for the first
    # was still on its way
    event = _spawned(cloud["image_id"])
    first = event["destination"]["host"]
    event["destination"] = boot.reschedule_build(event)
    boot.bind_resources_at_dest(event)
    late = {**event, "destination": {**event["destination"], "host": first}}

    with pytest.raises(errors.UnexpectedTaskState):
        boot.finish_build(late)

    instance = _instance(event["instance_uuid"])
    assert (instance.task_state, instance.launched_on, instance.host) == (
        states.SPAWNING, None, event["destination"]["host"])
    boot.finish_build(event)  # the build on the new host still finishes
    assert _instance(event["instance_uuid"]).launched_on == event["destination"]["host"]


def test_a_finish_build_refused_by_a_delete_is_not_committed_and_its_rollback_puts_the_ports_down(cloud):
    # GIVEN the owner deleted the server while it was spawning
    event = _spawned(cloud["image_id"])
    _delete_as_the_api_does(event["instance_uuid"])

    with pytest.raises(errors.UnexpectedTaskState):
        boot.finish_build(event)

    assert boot.check_build_committed(event) == {"committed": False}
    boot.unbind_resources_at_dest(event)
    assert _port_states(event["instance_uuid"]) == [("DOWN", [])]


def test_fail_build_of_a_server_being_deleted_releases_the_claim_and_leaves_the_rest_to_the_delete(cloud):
    event = _spawned(cloud["image_id"])
    _delete_as_the_api_does(event["instance_uuid"])
    event["error"] = {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}

    assert boot.fail_build(event) == {}
    assert boot.fail_build(event) == {}  # delivered again: one fault all the same

    assert placement.get_allocations(event["instance_uuid"]) == {}
    # in ERROR, so that a delete that then fails to start leaves a failed build, not one building
    instance = _instance(event["instance_uuid"])
    assert (instance.vm_state, instance.task_state) == (states.ERROR, states.DELETING)
    with cell_session("cell1") as session:  # and says why, with the build's event closed
        assert tuple(session.execute(select(InstanceFault.message, InstanceFault.details)).one()) == (
            "Ferry.SpawnFailed", "Cause: disk full")
        assert session.scalars(select(InstanceActionEvent.result).where(
            InstanceActionEvent.event == boot.EVENT_BUILD)).one() == "Error"


def test_fail_build_of_a_server_whose_delete_finished_meanwhile_releases_the_claim(cloud):
    event = _spawned(cloud["image_id"])
    _delete_as_the_api_does(event["instance_uuid"])
    delete.finish_delete({"instance_uuid": event["instance_uuid"], "request_id": "req-del", "cell": "cell1"})
    placement.claim(event["instance_uuid"], "demo", "u1",  # a reschedule's claim that landed after it
                    {placement.provider_by_host("cell1-host2"): {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}})

    assert boot.fail_build({**event, "error": {"Error": "Ferry.SpawnFailed", "Cause": "disk full"}}) == {}

    assert placement.get_allocations(event["instance_uuid"]) == {}
    assert _instance(event["instance_uuid"]).deleted


def test_no_valid_host_for_a_server_deleted_before_it_was_scheduled_is_not_buried(cloud):
    # GIVEN no host fits, and the owner deletes the server before the workflow fails the build
    event = accept_server(cloud["image_id"], flavor={**FLAVOR, "vcpus": 64})
    with pytest.raises(errors.NoValidHost) as raised:
        boot.select_destinations(event)
    _delete_unscheduled(event["instance_uuid"])

    assert boot.fail_build({**event, "error": {"Error": "Ferry.NoValidHost", "Cause": raised.value.message}}) == {}

    with cell_session("cell0") as session:
        assert session.scalars(select(Instance)).first() is None
    with api_session() as session:
        mapping = session.scalars(select(InstanceMapping)).one()
    assert (mapping.cell, mapping.queued_for_delete) == (None, True)


def test_reschedule_skips_an_alternate_filled_meanwhile_for_the_next(cloud):
    # GIVEN a build with two alternates, the first of which another boot filled since
    third = "cell1-host3"
    aws.client("sqs").create_queue(QueueName=protocol.host_queue_name(config.get().host_queue_prefix, third))
    report(third, "cell1", vcpus=4, memory_mb=4096, disk_gb=20)
    event = accept_server(cloud["image_id"])
    first = boot.select_destinations(event)
    event["destination"] = first
    full, spare = first["alternates"]
    report(full["host"], "cell1", vcpus=1, memory_mb=4096, disk_gb=20)
    boot.bind_resources_at_dest(event)
    boot.unbind_resources_at_dest(event)

    # WHEN the spawn on the first host failed and the build is rescheduled
    second = boot.reschedule_build(event)

    # THEN the claim moved to the alternate that still fits, as Nova tries each in turn
    assert (second["host"], second["alternates"]) == (spare["host"], [])
    assert used_on(first["host"]) == used_on(full["host"]) == {}
    assert used_on(spare["host"]) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}


def test_reschedule_of_a_server_being_deleted_claims_no_alternate(cloud):
    event = _spawned(cloud["image_id"])
    first, [alternate] = event["destination"]["host"], event["destination"]["alternates"]
    boot.unbind_resources_at_dest(event)
    _delete_as_the_api_does(event["instance_uuid"])

    with pytest.raises(errors.UnexpectedTaskState):
        boot.reschedule_build(event)

    assert used_on(alternate["host"]) == {}
    assert used_on(first) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}  # FailBuild releases it


def test_reschedule_run_twice_claims_the_alternate_once(cloud):
    event = _spawned(cloud["image_id"])
    boot.unbind_resources_at_dest(event)

    first = boot.reschedule_build(event)
    again = boot.reschedule_build(event)  # a retried invocation whose first run had finished

    assert again == first
    assert used_on(event["destination"]["host"]) == {}
    assert used_on(first["host"]) == {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 2}
    instance = _instance(event["instance_uuid"])
    assert (instance.host, instance.task_state) == (None, states.SCHEDULING)


@pytest.mark.parametrize("failure", [errors.BuildRequestChanged("kept changing"), RuntimeError("timed out")],
                         ids=["hand-over-refused", "step-died"])
def test_a_retried_select_destinations_for_a_server_deleted_since_the_claim_is_abandoned(cloud, monkeypatch,
                                                                                          failure):
    # GIVEN the first run claimed a host and failed before handing the server over
    event = accept_server(cloud["image_id"])

    def failing_hand_over(uuid, cell):
        raise failure

    monkeypatch.setattr(boot, "_hand_over", failing_hand_over)
    with pytest.raises(type(failure)):
        boot.select_destinations(event)
    monkeypatch.undo()
    assert placement.get_allocations(event["instance_uuid"]) != {}
    # AND the owner deleted the server before the retry
    _delete_unscheduled(event["instance_uuid"])

    # WHEN the step is retried
    assert boot.select_destinations(event) == {"abandoned": True}

    # THEN no claim and no copy of the server is left
    assert placement.get_allocations(event["instance_uuid"]) == {}
    with cell_session("cell1") as session:
        assert session.scalars(select(Instance)).first() is None
        assert session.scalars(select(InstanceAction)).first() is None


def scheduled_from_volume(image_id: str) -> tuple[dict, str]:
    """A server booted from an existing volume (no device named), scheduled into its cell: the
    boot's event and the volume's id, reserved for the server as the API leaves it."""
    event = accept_server(image_id)
    with api_session() as session:
        volume = Volume(project_id="demo", size_gb=1, path="/var/lib/ferry/volumes/v1", status="reserved")
        session.add(volume)
        session.flush()
        session.add(VolumeAttachment(volume_id=volume.id, instance_uuid=event["instance_uuid"], status="reserved"))
        volume_id = volume.id
    event["destination"] = boot.select_destinations(event)
    with cell_session("cell1") as session:
        session.add(BlockDeviceMapping(instance_uuid=event["instance_uuid"], source_type="volume",
                                       destination_type="volume", boot_index=0, volume_id=volume_id))
    return event, volume_id


def test_the_root_volume_keeps_the_device_it_was_given(cloud):
    event, volume_id = scheduled_from_volume(cloud["image_id"])

    args = boot.bind_resources_at_dest(event)["spawn_args"]

    assert [(v["volume_id"], v["device"]) for v in args["volumes"]] == [(volume_id, "vda")]
    with cell_session("cell1") as session:
        assert session.scalars(select(BlockDeviceMapping.device_name)).one() == "vda"


@pytest.mark.parametrize("source", ["volume", "image"])
def test_only_a_volume_the_build_creates_is_sent_to_its_host_with_a_size_to_make_it(cloud, source):
    # GIVEN a server booted from an existing volume, or from a new one made from an image
    event, volume_id = scheduled_from_volume(cloud["image_id"])
    if source == "image":
        with cell_session("cell1") as session:
            session.execute(update(BlockDeviceMapping).values(source_type="image", image_id=cloud["image_id"]))

    # WHEN its resources are bound
    args = boot.bind_resources_at_dest(event)["spawn_args"]

    # THEN only the new volume carries a size (and its image): the host never makes an existing one anew
    protocol.validate(args, protocol.SPAWN_ARGS_SCHEMA)
    [volume] = args["volumes"]
    assert (volume["source_type"], volume.get("size_gb"), "source_image" in volume) == (
        (source, None, False) if source == "volume" else (source, 1, True))


def test_a_server_deleted_before_its_resources_are_bound_gets_none_bound(cloud):
    # GIVEN a server being built whose delete finished (its host down: at once) after the build's
    # task swap, releasing its volume and queueing its mapping for delete
    event, volume_id = scheduled_from_volume(cloud["image_id"])
    with api_session() as session:
        session.execute(update(InstanceMapping).where(InstanceMapping.instance_uuid == event["instance_uuid"])
                        .values(queued_for_delete=True))
        session.query(VolumeAttachment).delete()
        session.execute(update(Volume).values(status="available"))

    # WHEN BindResourcesAtDest runs, THEN it is refused and binds nothing
    with pytest.raises(errors.UnexpectedTaskState, match="deleted while it was being built"):
        boot.bind_resources_at_dest(event)
    with api_session() as session:
        assert session.scalars(select(VolumeAttachment)).all() == []
        assert session.scalars(select(Volume.status)).one() == "available"
        assert session.scalars(select(PortBinding)).all() == []
